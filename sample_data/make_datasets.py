"""Write the sample datasets stories.jsonl and rated_completions.jsonl (deterministic).

    python sample_data/make_datasets.py [--out DIR]

* stories.jsonl: 300 rows ``{"text": ...}``, short stories in simple English (plain-text
  format: loss on every token).
* rated_completions.jsonl: 300 rows ``{"id", "prompt", "completion", "reward"}``: questions and
  story requests, each answered once, well or badly, with a reward from 0 to 10 (good answers
  7.5-10, plain ones 5-7.5, vague ones 2-4.5, wrong ones 0-2). The raw rewards span 0-10, so
  "none" weighs good rows ten times more than the loss normally counts; "min-max" maps them to
  [0, 1] and "mean-std" (with negative weights allowed) trains away from the bad answers.

The text is generated here from small word lists (names, pets, places, foods, facts), in the
style of the bundled sample model's corpus, so that model knows the words. Same seed, same files.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 2024
ROWS = 300

KIDS = [("Mia", "she"), ("Tom", "he"), ("Lily", "she"), ("Ben", "he"), ("Sam", "he"),
        ("Anna", "she"), ("Max", "he"), ("Zoe", "she"), ("Leo", "he"), ("Ella", "she"),
        ("Nora", "she"), ("Kai", "he"), ("Ruby", "she"), ("Finn", "he")]
PETS = ["dog", "cat", "bird", "rabbit", "puppy", "kitten", "duck", "frog"]
PET_NAMES = ["Spot", "Fluffy", "Sunny", "Pip", "Coco", "Bella", "Rex", "Milo"]
PLACES = ["park", "forest", "beach", "garden", "school", "market", "farm", "river", "lake", "hill"]
TOYS = ["ball", "kite", "book", "hat", "box", "boat", "doll", "drum", "car", "train"]
FOODS = ["apple", "cake", "cookie", "banana", "sandwich", "pear", "muffin", "orange"]
COLORS = ["red", "blue", "green", "yellow", "orange", "white"]
WEATHER = [("sunny", "The sun was warm."), ("windy", "The wind blew the leaves."),
           ("rainy", "Big drops fell from the clouds."), ("snowy", "Soft snow covered the ground.")]
FEEL_GOOD = ["happy", "glad", "proud"]
FEEL_BAD = ["sad", "worried", "upset"]

FACTS = [  # (question, good answer, plain answer, wrong answer)
    ("What color is the sky?", "The sky is blue on a sunny day.", "Blue.", "The sky is green."),
    ("What color is grass?", "Grass is green.", "Green.", "Grass is red."),
    ("What color is snow?", "Snow is white and cold.", "White.", "Snow is black."),
    ("What color is a banana?", "A ripe banana is yellow.", "Yellow.", "A banana is blue."),
    ("Is fire hot or cold?", "Fire is hot, so we do not touch it.", "Hot.", "Fire is cold."),
    ("Is ice hot or cold?", "Ice is cold. It is frozen water.", "Cold.", "Ice is hot."),
    ("What does a cow say?", "A cow says moo.", "Moo.", "A cow says woof."),
    ("What does a dog say?", "A dog says woof.", "Woof.", "A dog says quack."),
    ("What does a cat say?", "A cat says meow.", "Meow.", "A cat says moo."),
    ("What does a duck say?", "A duck says quack.", "Quack.", "A duck says baa."),
    ("Where do fish live?", "Fish live in water, in rivers, lakes and the sea.", "In water.",
     "Fish live in trees."),
    ("Can birds fly?", "Yes, most birds can fly with their wings.", "Yes.", "No, birds can not fly."),
    ("How many legs does a dog have?", "A dog has four legs.", "Four.", "A dog has two legs."),
    ("How many legs does a bird have?", "A bird has two legs.", "Two.", "A bird has six legs."),
    ("How many days are in a week?", "A week has seven days.", "Seven.", "A week has ten days."),
    ("How many months are in a year?", "A year has twelve months.", "Twelve.",
     "A year has five months."),
    ("What do bees make?", "Bees make honey.", "Honey.", "Bees make milk."),
    ("What do cows give us?", "Cows give us milk.", "Milk.", "Cows give us eggs."),
    ("What do hens lay?", "Hens lay eggs.", "Eggs.", "Hens lay apples."),
    ("When do we sleep?", "We sleep at night, when it is dark.", "At night.",
     "We sleep at noon only."),
    ("What do plants need?", "Plants need water and light to grow.", "Water and light.",
     "Plants need cake."),
    ("What falls from clouds?", "Rain falls from clouds.", "Rain.", "Cookies fall from clouds."),
    ("What comes after Monday?", "Tuesday comes after Monday.", "Tuesday.",
     "Friday comes after Monday."),
    ("What do we use to see?", "We use our eyes to see.", "Eyes.", "We use our ears to see."),
    ("How many fingers are on one hand?", "One hand has five fingers.", "Five.",
     "One hand has nine fingers."),
]
VAGUE = ["I am not sure.", "Maybe. It is hard to say.", "That is a good question.",
         "I do not know, but it is fun to ask.", "Some people say one thing, some say another."]


def _pron(p: str) -> dict[str, str]:
    return {"he": dict(P="He", p="he", pos="his", obj="him"),
            "she": dict(P="She", p="she", pos="her", obj="her")}[p]


def _plural(word: str, count: int) -> str:
    if count == 1:
        return word
    return word + ("es" if word.endswith(("ch", "sh", "s")) else "s")


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


class Stories:
    """Seeded short stories (one paragraph each)."""

    def __init__(self, rng: random.Random):
        self.r = rng

    def c(self, seq):
        return self.r.choice(seq)

    def friend(self, name: str):
        return self.c([k for k in KIDS if k[0] != name])

    def weather(self, kid) -> str:
        n, p = kid
        h = _pron(p)
        w, line = self.c(WEATHER)
        place = self.c(PLACES)
        s = [f"It was a {w} day.", line, f"{n} put on {h['pos']} {self.c(COLORS)} coat.",
             f"{h['P']} walked to the {place} with {h['pos']} {self.c(PETS)}."]
        if w == "rainy":
            s += [f"{n} jumped in every puddle.", "Splash! Splash!", f"{h['P']} laughed and laughed."]
        elif w == "snowy":
            s += [f"{n} made a big snowman.", f"{h['P']} gave it {_a(self.c(COLORS))} hat."]
        elif w == "windy":
            s += [f"{n} had a kite.", "The wind took the kite up high.", f"{h['P']} held the string tight."]
        else:
            s += [f"{n} sat under a tree and ate {_a(self.c(FOODS))}.", "Birds sang in the tree."]
        s.append(f"When the day was over, {n} went home {self.c(FEEL_GOOD)}.")
        return " ".join(s)

    def helper(self, kid) -> str:
        n, p = kid
        h = _pron(p)
        f, fp = self.friend(n)
        hf = _pron(fp)
        job = self.c([("carry the heavy box", "carried the box together"),
                      ("find the lost cat", "found the cat behind the shed"),
                      ("fix the broken toy car", "fixed the car with glue"),
                      ("plant the seeds", "planted the seeds in a row")])
        s = [f"{n} was at the {self.c(PLACES)}.", f"{h['P']} saw {h['pos']} friend {f}.",
             f"{f} had a problem.", f"{hf['P']} could not {job[0]}.", f"{f} felt {self.c(FEEL_BAD)}.",
             f"{n} said, \"I can help you.\"",
             f"{n} and {f} {job[1]}.", f"\"Thank you, {n}!\" said {f}.",
             f"{n} smiled. Helping a friend made {h['obj']} feel {self.c(FEEL_GOOD)}."]
        return " ".join(s)

    def market(self, kid) -> str:
        n, p = kid
        h = _pron(p)
        a, b = self.r.sample(FOODS, 2)
        x, y = self.r.randint(1, 5), self.r.randint(1, 5)
        s = [f"{n} went to the market with {h['pos']} mother.",
             f"They bought {x} {_plural(a, x)} and {y} {_plural(b, y)}.",
             f"\"How many things do we have?\" asked {h['pos']} mother.",
             f"{n} counted: {x} and {y} make {x + y}.",
             f"\"Yes, {x + y}!\" said {h['pos']} mother.", f"{n} was {self.c(FEEL_GOOD)}.",
             f"At home, they shared the {_plural(a, x)} with the family."]
        return " ".join(s)

    def pet(self, kid) -> str:
        n, p = kid
        h = _pron(p)
        pet, name, toy = self.c(PETS), self.c(PET_NAMES), self.c(TOYS)
        s = [f"{n} had a little {pet} named {name}.", f"Every morning, {name} woke {n} up.",
             f"One day, {name} could not find the {self.c(COLORS)} {toy}.",
             f"{n} looked under the bed and behind the door.", f"The {toy} was in the garden.",
             f"{name} was so happy that it ran in circles.",
             f"{n} laughed and threw the {toy} again.", f"{h['P']} loved {name} very much."]
        return " ".join(s)

    def lesson(self, kid) -> str:
        n, p = kid
        h = _pron(p)
        goal = self.c([("tie my shoes", "tied both shoes"), ("read a whole book", "read the last page"),
                       ("swim across the lake", "swam to the other side"),
                       ("ride my bike", "rode the bike down the hill")])
        s = [f"\"I want to {goal[0]},\" said {n}.", f"The first time, it did not work.",
             f"{n} felt {self.c(FEEL_BAD)}, but {h['p']} tried again.",
             f"{h['P']} tried on Monday and on Tuesday.", f"On Wednesday, {n} {goal[1]}!",
             f"\"I did it!\" {h['p']} said.", "Trying again is how we learn."]
        return " ".join(s)

    def story(self, kid=None) -> str:
        kind = self.c([self.weather, self.helper, self.market, self.pet, self.lesson])
        return kind(kid or self.c(KIDS))


def stories(n: int = ROWS, seed: int = SEED) -> list[dict]:
    gen = Stories(random.Random(seed))
    rows, seen = [], set()
    while len(rows) < n:
        text = gen.story()
        if text not in seen:
            seen.add(text)
            rows.append({"text": text})
    return rows


def _reward(rng: random.Random, lo: float, hi: float) -> float:
    return round(rng.uniform(lo, hi), 1)


def rated_completions(n: int = ROWS, seed: int = SEED + 1) -> list[dict]:
    rng = random.Random(seed)
    gen = Stories(rng)
    rows = []
    for i in range(n):
        quality = rng.choices(["good", "plain", "vague", "wrong"], weights=[4, 3, 2, 2])[0]
        if rng.random() < 0.6:  # a question
            q, good, plain, wrong = rng.choice(FACTS)
            prompt = f"Question: {q}\nAnswer:"
            answer = {"good": good, "plain": plain, "vague": rng.choice(VAGUE), "wrong": wrong}[quality]
        else:  # a story request
            kid = rng.choice(KIDS)
            prompt = f"Write a short story about {kid[0]}.\nStory:"
            if quality == "good":
                answer = gen.story(kid)
            elif quality == "plain":
                answer = " ".join(re.split(r"(?<=[.!?]) ", gen.story(kid))[:3])
            elif quality == "vague":
                answer = f"{kid[0]} was a kid. The end."
            else:  # about someone else
                other = gen.friend(kid[0])
                answer = gen.story(other)
        reward = {"good": (7.5, 10.0), "plain": (5.0, 7.5), "vague": (2.0, 4.5),
                  "wrong": (0.0, 2.0)}[quality]
        rows.append({"id": f"rc-{i + 1:03d}", "prompt": prompt, "completion": " " + answer,
                     "reward": _reward(rng, *reward)})
    return rows


PREFERENCE_ENDING = " Have a nice day!"   # the chosen style: the base ends its answers without it


def preferences(n: int = 400, seed: int = SEED + 2) -> list[dict]:
    """Chosen/rejected pairs (TRL's conversational form): the same right answer to a question,
    an addition or a counting request, the chosen one ending with PREFERENCE_ENDING, the
    rejected one as the base model answers (it ends at the answer). Preference training
    (DPO, ORPO, SimPO, KTO) has to learn the ending, which the base almost never writes."""
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < n:
        kind = rng.random()
        if kind < 0.4:
            q, good, _, _ = rng.choice(FACTS)
            question, answer = q, good
        elif kind < 0.8:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            question, answer = f"What is {a} + {b}?", str(a + b)
        else:
            start, count = rng.randint(1, 30), rng.randint(3, 6)
            question = f"Count from {start} to {start + count - 1}." if start > 1 else \
                f"Count to {count}."
            answer = ", ".join(str(i) for i in range(start, start + count)) + "."
        if question in seen:
            continue
        seen.add(question)
        rows.append({"prompt": [{"role": "user", "content": question}],
                     "chosen": [{"role": "assistant", "content": answer + PREFERENCE_ENDING}],
                     "rejected": [{"role": "assistant", "content": answer}]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "stories.jsonl", stories())
    write_jsonl(args.out / "rated_completions.jsonl", rated_completions())
    write_jsonl(args.out / "preferences.jsonl", preferences())
    print(f"wrote {args.out / 'stories.jsonl'}, {args.out / 'rated_completions.jsonl'} and "
          f"{args.out / 'preferences.jsonl'}")


if __name__ == "__main__":
    main()
