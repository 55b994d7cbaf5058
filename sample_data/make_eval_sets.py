"""Writes the sample world's evaluation sets (issue 32), for `workbench eval` and the Evaluate
screen: `eval_suite.jsonl`, a prompt suite (chat prompts scored for the answer style the sample SFT
data teaches, `regex:^Sure! `, and for the answer itself: `numeric` for the additions, `contains`
the fact for the facts; an answer passes with both), and `eval_tasks.jsonl`, multiple choice on the same prompts (the
answer in that style against the plain answer and a wrong one). The additions are the first of
`addition.jsonl` (never in the corpus nor in chat.jsonl); the facts are the corpus's. Then 16
rows for what the preference pairs teach (`preferences.jsonl`: the right answer, ending with
" Have a nice day!"): additions and counting requests that are not among the pairs' prompts,
scored for the answer (`numeric`, `contains`) and for the ending (`regex:Have a nice day!$`),
and as multiple choice the answer with the ending against the plain answer and a wrong one with
the ending. Seeded.

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
from sample_data.make_datasets import PREFERENCE_ENDING  # noqa: E402


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
    styles = [("regex:^Sure! ", lambda text: f"Sure! {text}")] * len(rows)
    rows_pref, styles_pref = preference_rows()
    rows += rows_pref
    styles += styles_pref
    with open(HERE / "eval_suite.jsonl", "w") as suite, \
            open(HERE / "eval_tasks.jsonl", "w") as tasks:
        for (messages, answer, wrong, check), (style, styled) in zip(rows, styles):
            suite.write(json.dumps({"messages": messages, "answer": answer,
                                    "reward": [style, check]}) + "\n")
            choices = [styled(answer), answer, styled(wrong)]
            rng.shuffle(choices)
            tasks.write(json.dumps({"messages": messages, "choices": choices,
                                    "answer": choices.index(styled(answer))}) + "\n")


def preference_rows() -> tuple[list, list]:
    """8 additions and 8 counting requests none of preferences.jsonl's prompts asks (its own
    seed: the rows before stay as they were), with the preference's ending as the style."""
    rng = random.Random(3232)
    taught = {json.loads(line)["prompt"][0]["content"]
              for line in (HERE / "preferences.jsonl").read_text().splitlines()}
    rows = []
    for line in (HERE / "addition.jsonl").read_text().splitlines()[24:]:
        row = json.loads(line)
        if len(rows) < 8 and row["messages"][0]["content"] not in taught:
            total = int(row["answer"])
            rows.append((row["messages"], str(total),
                         str(total + rng.choice([-10, -1, 1, 10])), "numeric"))
    while len(rows) < 16:
        start, count = rng.randint(31, 60), rng.randint(3, 6)     # pairs count from 1 to 35
        question = f"Count from {start} to {start + count - 1}."
        answer = ", ".join(str(i) for i in range(start, start + count)) + "."
        wrong = ", ".join(str(i) for i in range(start, start + count + 1)) + "."
        if question not in taught and all(r[0][0]["content"] != question for r in rows):
            rows.append(([{"role": "user", "content": question}], answer, wrong,
                         f"contains:{answer}"))
    ending = PREFERENCE_ENDING.strip()       # no regex metacharacter in it but the "!"
    return rows, [(f"regex:{ending}$", lambda text: text + PREFERENCE_ENDING)] * 16

if __name__ == "__main__":
    main()
