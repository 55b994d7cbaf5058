"""Writes the sample world's evaluation sets (issue 32), for `workbench eval` and the Evaluate
screen: `eval_suite.jsonl`, a prompt suite (chat prompts scored for the answer style the sample SFT
data teaches, `regex:^Sure! `, and for the answer itself: `numeric` for the additions, `contains`
the fact for the facts; an answer passes with both), and `eval_tasks.jsonl`, multiple choice on the same prompts (the
answer in that style against the plain answer and a wrong one). The additions are the first of
`addition.jsonl` (never in the corpus nor in chat.jsonl); the facts are the corpus's. Seeded.

    python sample_data/make_eval_sets.py
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from sample_data.build_sample_model import FACTS  # noqa: E402


def main() -> None:
    rng = random.Random(32)
    rows = []
    for line in (HERE / "addition.jsonl").read_text().splitlines()[:24]:
        row = json.loads(line)
        total = int(row["answer"])
        rows.append((row["messages"], str(total), str(total + rng.choice([-10, -1, 1, 10])),
                     "numeric"))
    for question, answer in FACTS[:16]:
        wrong = rng.choice([a for q, a in FACTS if a != answer])
        rows.append(([{"role": "user", "content": question}], answer, wrong,
                     f"contains:{answer}"))
    with open(HERE / "eval_suite.jsonl", "w") as suite, \
            open(HERE / "eval_tasks.jsonl", "w") as tasks:
        for messages, answer, wrong, check in rows:
            suite.write(json.dumps({"messages": messages, "answer": answer,
                                    "reward": ["regex:^Sure! ", check]}) + "\n")
            choices = [f"Sure! {answer}", answer, f"Sure! {wrong}"]
            rng.shuffle(choices)
            tasks.write(json.dumps({"messages": messages, "choices": choices,
                                    "answer": choices.index(f"Sure! {answer}")}) + "\n")


if __name__ == "__main__":
    main()
