"""Writes the multiple-choice task files of tests/data/eval/ from the sample corpus
(sample_data/corpus.txt, the project's own generated text): a HellaSwag file, a WinoGrande CSV,
a llama.cpp binary multiple-choice file and the same questions as JSONL. Seeded: the same files
every time. Run from the repository root: python tests/data/eval/make_tasks.py

Larger files for measuring parity (not committed: the fixtures stay the 60-task ones), e.g.
python tests/data/eval/make_tasks.py --n 300 --seed 7 --out /tmp/eval300
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from app.engine.evaluation.tasks import write_mc  # noqa: E402
from sample_data.build_sample_model import FACTS, KIDS  # noqa: E402

OUT = Path(__file__).parent
N = 60
MAX_CHARS = 180          # the golden tiny models read bytes and have a context of 256


def story_sentences() -> list[list[str]]:
    docs = (ROOT / "sample_data" / "corpus.txt").read_text().split("\n\n")
    out = []
    for doc in docs:
        if "<|im_start|>" in doc or '"' in doc:
            continue
        sentences = re.findall(r"[^.!?]+[.!?]", doc.strip())
        sentences = [s.strip() for s in sentences if s.strip()]
        if len(sentences) >= 4:
            out.append(sentences)
    return out


def hellaswag(rng: random.Random, docs, N: int = N) -> str:
    lines = []
    while len(lines) < 6 * N:
        doc = rng.choice(docs)
        k = rng.randrange(1, len(doc))
        words = doc[k].split()
        if len(words) < 5:
            continue
        cut = len(words) // 2
        context = "Story: " + doc[k - 1] + " " + " ".join(words[:cut])
        gold_ending = " ".join(words[cut:])
        endings = {gold_ending}
        while len(endings) < 4:
            w = rng.choice(rng.choice(docs)).split()
            if len(w) >= 4:
                endings.add(" ".join(w[len(w) // 2:]))
        endings.discard(gold_ending)
        endings = sorted(endings)
        if len(lines) // 6 % 8 == 3:      # endings sharing their first word: a longer prefix
            endings = ["then " + e for e in endings]
            gold_ending = "then " + gold_ending
        gold = rng.randrange(4)
        endings.insert(gold, gold_ending)
        if max(len(context) + 1 + len(e) for e in endings) > MAX_CHARS:
            continue
        lines += [context, str(gold), *endings]
    return "\n".join(lines) + "\n"


SOUNDS = [("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack"), ("sheep", "baa"),
          ("frog", "ribbit")]
COLORS = [("The sky", "blue"), ("Grass", "green"), ("Snow", "white"), ("A banana", "yellow"),
          ("The sun", "yellow"), ("Fire", "hot"), ("Ice", "cold")]


def winogrande(rng: random.Random, N: int = N) -> str:
    """Rows whose options change what follows the blank (a pronoun, a sound, a sum), and some
    with the blank at the end (llama.cpp then scores from the common prefix: the other rule)."""
    boys = [k for k, p in KIDS if p == "he"]
    girls = [k for k, p in KIDS if p == "she"]
    toys = ["ball", "kite", "book", "hat", "boat", "doll", "drum", "car", "train"]
    places = ["park", "forest", "beach", "garden", "school", "market", "farm", "lake", "zoo"]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["index", "sentence", "option1", "option2", "answer"])
    for n in range(N):
        kind = n % 4
        if kind == 0:       # the pronoun after the blank decides
            boy, girl = rng.choice(boys), rng.choice(girls)
            pron = rng.choice(["his", "her"])
            gold = boy if pron == "his" else girl
            first, second = (boy, girl) if rng.random() < 0.5 else (girl, boy)
            sentence = (f"{first} and {second} went to the {rng.choice(places)}. "
                        f"_ lost {pron} {rng.choice(toys)} there.")
            options = [boy, girl]
        elif kind == 1:     # the sound after the blank decides
            (animal, sound), (other, _) = rng.sample(SOUNDS, 2)
            sentence = f"We went to the farm, and we heard it. The _ says {sound}."
            gold, options = animal, [animal, other]
        elif kind == 2:     # the blank at the end
            (thing, color) = rng.choice(COLORS)
            other = rng.choice([c for _, c in COLORS if c != color])
            sentence = f"Here is a fact. {thing} is _."
            gold, options = color, [color, other]
        else:               # a sum
            kid = rng.choice(boys + girls)
            a, b = rng.randint(1, 5), rng.randint(1, 4)
            sentence = f"{kid} had {a} apples and got {b} more. Then {kid} had _ apples."
            gold, options = str(a + b), [str(a + b), str(a + b + rng.choice([-2, -1, 1, 2]))]
        rng.shuffle(options)
        # csv quotes a sentence with a comma: llama.cpp strips the quotes (no quote inside)
        w.writerow([n, sentence, *options, options.index(gold) + 1])
    return buf.getvalue()


def questions(rng: random.Random, N: int = N) -> list[tuple[str, list[str], int]]:
    out = []
    for i in range(N):
        q, a = FACTS[i % len(FACTS)]
        n_choices = 2 + i % 4
        wrong = rng.sample([f for _, f in FACTS if f != a], n_choices - 1)
        gold = rng.randrange(n_choices)
        wrong.insert(gold, a)
        out.append((f"Question: {q}\nAnswer:", wrong, gold))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=N, help=f"tasks per file (default {N})")
    ap.add_argument("--seed", type=int, default=0,
                    help="added to the fixtures' seeds (default 0: the committed files)")
    ap.add_argument("--out", type=Path, default=OUT, help="folder (default: this one)")
    args = ap.parse_args()
    n, out = args.n, args.out
    out.mkdir(parents=True, exist_ok=True)
    docs = story_sentences()
    (out / "hellaswag.txt").write_text(hellaswag(random.Random(2032 + args.seed), docs, n))
    (out / "winogrande.csv").write_text(winogrande(random.Random(2033 + args.seed), n))
    qs = questions(random.Random(2034 + args.seed), n)
    write_mc(out / "mc.bin", [(q, c, [int(j == g) for j in range(len(c))]) for q, c, g in qs])
    with open(out / "mc.jsonl", "w") as f:
        for q, c, g in qs:
            f.write(json.dumps({"question": q, "choices": c, "answer": g}) + "\n")


if __name__ == "__main__":
    main()
