"""Build everything in sample_data/ from nothing: corpus, tokenizer, tiny MoE model, datasets.

    /work/venv/bin/python sample_data/build_sample_model.py            # the whole build
    /work/venv/bin/python sample_data/build_sample_model.py --data-only   # text files only
    /work/venv/bin/python sample_data/build_sample_model.py --bench    # tokens/s of a few steps

Steps (all seeded, so a rebuild on the same machine gives the same files):

1. corpus.txt: the project's own procedurally generated English (stories, facts, counting,
   ChatML chats with two-digit additions). Documents are separated by a blank line.
2. A byte-level BPE tokenizer trained with `tokenizers` on the corpus, written as GGUF
   vocabulary (tokenizer.ggml.model "gpt2", pre "qwen2": digits are single tokens). The build
   checks that the workbench's GGUF tokenizer gives exactly the HF tokenizer's ids on the corpus.
3. tiny-moe.gguf: `create_model` (llama architecture, 8 experts, top-2) pretrained in full mode
   with AdamW + cosine schedule on packed documents, validation loss on held-out documents.
4. chat.jsonl, completions.jsonl (fine-tuning demos) and addition.jsonl (GRPO prompts), from the
   same generator with other seeds; never verbatim from the corpus.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from app.engine import load_model, load_tokenizer  # noqa: E402
from app.engine.text.chat_template import DEFAULT_CHAT_TEMPLATE  # noqa: E402
from app.engine.training.config import TrainConfig  # noqa: E402
from app.engine.io.gguf import write_gguf  # noqa: E402
from app.engine.model.new_model import NewModelSpec, create_model  # noqa: E402
from app.engine.data.batches import pack  # noqa: E402
from app.engine.training.session import TrainSession  # noqa: E402

CORPUS_SEED, DATASET_SEED, TRAIN_SEED = 1234, 5678, 42
CORPUS_BYTES = 1_000_000          # stop adding documents at about this size
VOCAB_SIZE = 2048                 # a cap: this corpus saturates at 1026 (every word is a token)
SPECIAL_TOKENS = ["<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
BOS, EOS, IM_START, IM_END, PAD = SPECIAL_TOKENS
CONTEXT = 256
SPEC = NewModelSpec(arch="llama", n_layer=4, n_embd=160, n_head=4, n_ff=224, n_expert=8,
                    n_expert_used=2, context_length=CONTEXT, init_std=0.02, seed=TRAIN_SEED,
                    name="tiny-moe (workbench sample)")
TRAIN = dict(steps=1500, windows_per_step=8, lr=3e-3, min_lr=3e-4, warmup=60, val_docs=0.04)

# The workbench's "qwen2" pre-tokenizer regex (llama.cpp's, see app/engine/text/tokenizer.py): letters
# with one leading non-letter, single digits, punctuation runs with trailing newlines, newlines.
QWEN2_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
            r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# =============================================================================================
# 1. The corpus generator
# =============================================================================================

KIDS = [("Mia", "she"), ("Tom", "he"), ("Lily", "she"), ("Ben", "he"), ("Sam", "he"),
        ("Anna", "she"), ("Max", "he"), ("Zoe", "she"), ("Leo", "he"), ("Ella", "she")]
NEW_KIDS = [("Nora", "she"), ("Kai", "he"), ("Ruby", "she"), ("Finn", "he")]  # datasets only
PETS = ["dog", "cat", "bird", "rabbit", "puppy", "kitten", "duck", "frog"]
PLACES = ["park", "forest", "beach", "garden", "school", "market", "farm", "river", "lake",
          "hill", "zoo", "library"]
TOYS = ["ball", "kite", "book", "hat", "box", "boat", "doll", "drum", "car", "train"]
FOODS = ["apple", "cake", "cookie", "banana", "sandwich", "pear", "muffin", "orange"]
ADJ = ["red", "blue", "green", "yellow", "big", "small", "new", "shiny", "old", "soft"]
HIDE = ["under a tree", "behind a rock", "near the water", "under a bench", "in the grass",
        "behind a big box", "next to the gate", "under the slide"]
FEEL_GOOD = ["happy", "glad", "very happy", "proud"]
FEEL_BAD = ["sad", "worried", "upset"]
ANIMALS = ["ducks", "birds", "frogs", "cows", "sheep", "fish", "cats", "dogs", "rabbits"]
NUM_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
             "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
             "seventeen", "eighteen", "nineteen", "twenty"]

FACTS = [
    ("What color is the sky?", "The sky is blue."),
    ("What color is grass?", "Grass is green."),
    ("What color is snow?", "Snow is white."),
    ("What color is a banana?", "A banana is yellow."),
    ("What color is an orange?", "An orange is orange."),
    ("What color is the sun?", "The sun is yellow."),
    ("Is fire hot or cold?", "Fire is hot."),
    ("Is ice hot or cold?", "Ice is cold."),
    ("What does a cow say?", "A cow says moo."),
    ("What does a dog say?", "A dog says woof."),
    ("What does a cat say?", "A cat says meow."),
    ("What does a duck say?", "A duck says quack."),
    ("What does a sheep say?", "A sheep says baa."),
    ("What does a frog say?", "A frog says ribbit."),
    ("Where do fish live?", "Fish live in water."),
    ("Can birds fly?", "Yes, birds can fly."),
    ("Can fish fly?", "No, fish can not fly. Fish swim."),
    ("How many legs does a dog have?", "A dog has four legs."),
    ("How many legs does a bird have?", "A bird has two legs."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("How many days are in a week?", "A week has seven days."),
    ("How many months are in a year?", "A year has twelve months."),
    ("How many hours are in a day?", "A day has twenty four hours."),
    ("What do bees make?", "Bees make honey."),
    ("What do cows give us?", "Cows give us milk."),
    ("What do hens lay?", "Hens lay eggs."),
    ("When do we sleep?", "We sleep at night."),
    ("When is the sun in the sky?", "The sun is in the sky in the day."),
    ("What do plants need?", "Plants need water and light."),
    ("What falls from clouds?", "Rain falls from clouds."),
    ("What is the first day of the week?", "The first day of the week is Monday."),
    ("What comes after Monday?", "Tuesday comes after Monday."),
    ("What do we use to see?", "We use our eyes to see."),
    ("What do we use to hear?", "We use our ears to hear."),
    ("How many fingers are on one hand?", "One hand has five fingers."),
]
GREETINGS = [("Hi!", "Hello! How can I help you?"), ("Hello!", "Hi! What can I do for you?"),
             ("Good morning!", "Good morning! How can I help?"),
             ("Thank you!", "You are welcome!"), ("Thanks!", "You are welcome!"),
             ("Who are you?", "I am a small helper. I can tell stories and add numbers."),
             ("Bye!", "Bye! Have a nice day!")]


def _pron(p: str) -> dict[str, str]:
    return {"he": dict(P="He", p="he", pos="his", obj="him"),
            "she": dict(P="She", p="she", pos="her", obj="her")}[p]


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


class Gen:
    """Seeded text generator: stories, facts, counting, and ChatML chats."""

    def __init__(self, seed: int, kids=KIDS, exclude_sums: set | None = None):
        self.r = random.Random(seed)
        self.kids = kids
        self.exclude_sums = exclude_sums or set()

    def c(self, seq):
        return self.r.choice(seq)

    def two_kids(self):
        a, b = self.r.sample(self.kids, 2)
        return a, b

    # ---- stories (one paragraph each) ----
    def story_lost(self, hero=None) -> str:
        (n, p), (f, fp) = self.two_kids()
        if hero:
            n, p = hero
            f, fp = self.c([k for k in self.kids if k[0] != n])
        h = _pron(p)
        toy, adj, place, spot = self.c(TOYS), self.c(ADJ), self.c(PLACES), self.c(HIDE)
        opening = self.c([f"Once upon a time, there was a {'girl' if p == 'she' else 'boy'} named {n}.",
                          f"{n} had {_a(adj)} {toy}.", f"One day, {n} went to the {place}."])
        s = [opening]
        if not opening.startswith(f"{n} had"):
            s.append(f"{h['P']} had {_a(adj)} {toy}.")
        if "went to" not in opening:
            s.append(f"One day, {h['p']} took the {toy} to the {place}.")
        else:
            s.append(f"{h['P']} took the {toy} with {h['obj']}.")
        s.append(self.c([f"{h['P']} played with the {toy} all morning.",
                         f"{n} played and played.", f"{h['P']} had a lot of fun."]))
        s.append(f"Then the {toy} was gone!")
        s.append(f"{n} was {self.c(FEEL_BAD)}.")
        s.append(f"{h['P']} looked {self.c(HIDE)}, but the {toy} was not there.")
        s.append(f"{f} came to help.")
        s.append(f"\"Let's look {spot},\" said {f}.")
        s.append(f"They found the {toy} {spot}!")
        s.append(self.c([f"{n} smiled and said, \"Thank you, {f}!\"",
                         f"\"Thank you, {f}!\" said {n}."]))
        s.append(self.c(["They went home together.", "They played until the sun went down.",
                         f"{n} and {f} were {self.c(FEEL_GOOD)}."]))
        return " ".join(s)

    def story_pet(self, hero=None) -> str:
        n, p = hero or self.c(self.kids)
        h = _pron(p)
        pet, place, toy = self.c(PETS), self.c(PLACES), self.c(TOYS)
        pet_name = self.c(["Spot", "Fluffy", "Sunny", "Pip", "Coco", "Bella", "Rex", "Milo"])
        s = [self.c([f"{n} had a {pet} named {pet_name}.",
                     f"Once upon a time, {n} had a little {pet} called {pet_name}."])]
        s.append(f"{pet_name} liked to play with {_a(self.c(ADJ))} {toy}.")
        s.append(f"One day, {n} and {pet_name} went to the {place}.")
        event = self.r.randrange(3)
        if event == 0:
            s += [f"{pet_name} saw {_a(self.c(['butterfly', 'bird', 'frog', 'leaf', 'bee']))} and ran after it.",
                  f"{n} ran too, but {h['p']} could not keep up.",
                  f"\"Come back, {pet_name}!\" called {n}.",
                  f"{pet_name} stopped and came back to {n}.",
                  f"{n} gave {pet_name} a big hug."]
        elif event == 1:
            food = self.c(FOODS)
            s += [f"{n} had {_a(food)} in {h['pos']} bag.",
                  f"{pet_name} wanted the {food} too.",
                  f"{n} laughed and gave {pet_name} a small piece.",
                  f"\"Sharing is good,\" said {n}."]
        else:
            s += ["It started to rain.",
                  f"{n} and {pet_name} got wet.",
                  f"They ran home and sat by the warm fire.",
                  f"Soon {pet_name} fell asleep on {n}'s lap."]
        s.append(self.c([f"{n} loved {pet_name} very much.", f"It was a good day.",
                         f"{n} was {self.c(FEEL_GOOD)}."]))
        return " ".join(s)

    def story_share(self, hero=None) -> str:
        (n, p), (f, fp) = self.two_kids()
        if hero:
            n, p = hero
            f, fp = self.c([k for k in self.kids if k[0] != n])
        h, hf = _pron(p), _pron(fp)
        food, place = self.c(FOODS), self.c(PLACES)
        k = self.r.randint(2, 6)
        s = [f"{n} and {f} were at the {place}.",
             f"{n} had {k} {food}s." if k > 1 else f"{n} had one {food}.",
             f"{f} had no {food}s.",
             f"{hf['P']} looked {self.c(FEEL_BAD)}."]
        give = self.r.randint(1, k - 1)
        s += [f"{n} gave {give} {food}{'s' if give > 1 else ''} to {f}.",
              f"Now {n} had {k - give} and {f} had {give}.",
              f"\"Thank you,\" said {f}. \"You are a good friend.\"",
              f"They ate the {food}s together and {self.c(['laughed', 'talked', 'sang a song'])}."]
        return " ".join(s)

    def story_count(self, hero=None) -> str:
        n, p = hero or self.c(self.kids)
        h = _pron(p)
        animal, place = self.c(ANIMALS), self.c(PLACES)
        a, b = self.r.randint(2, 9), self.r.randint(2, 9)
        s = [f"{n} went to the {place}.",
             f"{h['P']} saw {a} {animal}.",
             f"Then {b} more {animal} came.",
             f"{n} counted them: {', '.join(str(i) for i in range(1, a + b + 1))}.",
             f"Now there were {a + b} {animal}!",
             f"{a} + {b} = {a + b}."]
        return " ".join(s)

    def story_try(self, hero=None) -> str:
        n, p = hero or self.c(self.kids)
        h = _pron(p)
        goal, verb = self.c([("climb the big hill", "climbed"), ("ride a bike", "rode the bike"),
                             ("swim in the lake", "swam"), ("fly a kite", "flew the kite"),
                             ("read a book", "read the book"), ("bake a cake", "baked the cake")])
        s = [f"{n} wanted to {goal}.",
             f"The first time, {h['p']} fell down.",
             f"{n} was {self.c(FEEL_BAD)}, but {h['p']} did not give up.",
             f"{h['P']} tried again and again.",
             f"At last, {h['p']} {verb}!",
             self.c([f"\"I did it!\" said {n}.", f"{n} was {self.c(FEEL_GOOD)}."]),
             self.c(["Trying again is how we learn.", "It was the best day ever."])]
        return " ".join(s)

    def story(self, hero=None) -> str:
        kind = self.c([self.story_lost, self.story_lost, self.story_pet, self.story_pet,
                       self.story_share, self.story_try, self.story_count])
        return kind(hero)

    # ---- facts and counting ----
    def facts(self) -> str:
        return " ".join(a for _, a in self.r.sample(FACTS, self.r.randint(3, 7)))

    def counting(self) -> str:
        kind = self.r.randrange(4)
        if kind == 0:
            start = self.r.randint(1, 60)
            n = self.r.randint(5, 12)
            return f"Let's count: {', '.join(str(i) for i in range(start, start + n))}."
        if kind == 1:
            start = self.r.randint(1, 12)
            return f"Count with words: {', '.join(NUM_WORDS[start:start + self.r.randint(4, 8)])}."
        if kind == 2:
            start = self.r.randint(5, 20)
            return f"Count down: {', '.join(str(i) for i in range(start, 0, -1))}. Go!"
        step = self.r.choice([2, 5, 10])
        return f"Count by {step}s: {', '.join(str(step * i) for i in range(1, self.r.randint(5, 10)))}."

    # ---- chats ----
    def addition_pair(self):
        while True:
            a, b = self.r.randint(10, 99), self.r.randint(10, 99)
            if (a, b) not in self.exclude_sums:
                return a, b

    def turn(self) -> tuple[str, str]:
        kind = self.r.choices(["add", "add_small", "add_words", "fact", "count", "next", "story",
                               "greet"], weights=[12, 1, 1, 3, 1, 1, 1, 1])[0]
        if kind == "add":
            a, b = self.addition_pair()
            return f"What is {a} + {b}?", str(a + b)
        if kind == "add_small":
            a, b = self.r.randint(0, 9), self.r.randint(0, 9)
            return f"What is {a} + {b}?", str(a + b)
        if kind == "add_words":
            a, b = self.addition_pair()
            return f"Add {a} and {b}.", f"{a} + {b} = {a + b}."
        if kind == "fact":
            return self.c(FACTS)
        if kind == "count":
            n = self.r.randint(3, 10)
            return f"Count to {n}.", ", ".join(str(i) for i in range(1, n + 1)) + "."
        if kind == "next":
            n = self.r.randint(1, 98)
            return f"What comes after {n}?", f"{n + 1} comes after {n}."
        if kind == "story":
            hero = self.c(self.kids)
            return f"Tell me a story about {hero[0]}.", self.story(hero)
        return self.c(GREETINGS)

    def messages(self) -> list[dict]:
        msgs = []
        if self.r.random() < 0.15:
            msgs.append({"role": "system", "content": "You are a helpful assistant."})
        for _ in range(self.r.choices([1, 2, 3], weights=[6, 3, 1])[0]):
            q, a = self.turn()
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return msgs

    def document(self) -> str:
        kind = self.r.choices(["story", "facts", "count", "chat"], weights=[38, 6, 6, 50])[0]
        if kind == "story":
            return self.story()
        if kind == "facts":
            return self.facts()
        if kind == "count":
            return self.counting()
        return chatml(self.messages())


def chatml(messages: list[dict]) -> str:
    """ChatML exactly as DEFAULT_CHAT_TEMPLATE renders it, without the trailing newline."""
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)[:-1]


def addition_prompts(n: int = 200, seed: int = DATASET_SEED) -> list[tuple[int, int]]:
    r = random.Random(seed)
    pairs: list[tuple[int, int]] = []
    while len(pairs) < n:
        pair = (r.randint(10, 99), r.randint(10, 99))
        if pair not in pairs:
            pairs.append(pair)
    return pairs


def build_corpus() -> list[str]:
    """Documents of the pretraining corpus; the GRPO prompts' additions never appear in it."""
    gen = Gen(CORPUS_SEED, exclude_sums=set(addition_prompts()))
    docs, size, seen = [], 0, set()
    while size < CORPUS_BYTES:
        doc = gen.document()
        if doc in seen and not doc.startswith(IM_START):  # keep short chats even if repeated
            continue
        seen.add(doc)
        docs.append(doc)
        size += len(doc.encode()) + 2
    assert not any("\n\n" in d for d in docs)
    return docs


def build_datasets(corpus_docs: set[str]):
    """chat.jsonl, completions.jsonl and addition.jsonl rows (never verbatim corpus documents).

    chat.jsonl teaches a new style ("Sure! ..." answers), completions.jsonl stories with new
    characters, so that fine-tuning has something visible to learn.
    """
    gen = Gen(DATASET_SEED + 1, exclude_sums=set(addition_prompts()))
    chat = []
    while len(chat) < 300:
        msgs = gen.messages()
        if chatml(msgs) in corpus_docs:
            continue
        for m in msgs:
            if m["role"] == "assistant":
                m["content"] = "Sure! " + m["content"]
        chat.append({"messages": msgs})
    gen_new = Gen(DATASET_SEED + 2, kids=KIDS[:4] + NEW_KIDS)
    completions = []
    while len(completions) < 300:
        doc = gen_new.story(gen_new.c(NEW_KIDS))
        if doc in corpus_docs:
            continue
        cut = doc.index(". ") + 1 if gen_new.r.random() < 0.5 else doc.index(". ", doc.index(". ") + 2) + 1
        completions.append({"prompt": doc[:cut], "completion": doc[cut:]})
    additions = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
                 for a, b in addition_prompts()]
    return chat, completions, additions


# =============================================================================================
# 2. The tokenizer
# =============================================================================================

def train_tokenizer(docs: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_RE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    return tok


def tokenizer_metadata(tok) -> dict:
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    assert None not in tokens and tokens[:len(SPECIAL_TOKENS)] == SPECIAL_TOKENS
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = np.ones(len(tokens), np.int32)
    types[:len(SPECIAL_TOKENS)] = 3  # CONTROL
    ids = {t: i for i, t in enumerate(tokens)}
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": np.zeros(len(tokens), np.float32),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": ids[BOS],
        "tokenizer.ggml.eos_token_id": ids[EOS],
        "tokenizer.ggml.eot_token_id": ids[IM_END],
        "tokenizer.ggml.padding_token_id": ids[PAD],
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": DEFAULT_CHAT_TEMPLATE,
    }


def check_tokenizer(hf, gguf_tok, docs: list[str]) -> None:
    """The GGUF tokenizer must give exactly the HF tokenizer's ids (and round-trip) on the corpus."""
    text = "\n\n".join(docs)
    ours = gguf_tok.encode(text, add_special=False, parse_special=True)
    theirs = hf.encode(text, add_special_tokens=False).ids
    assert ours == theirs, "GGUF tokenizer differs from the HF tokenizer on the corpus"
    assert gguf_tok.decode(ours) == text, "the corpus does not round-trip through the tokenizer"
    for doc in docs[:2000]:  # per document too, with BOS and without special-token parsing
        assert gguf_tok.encode(doc, parse_special=True) == [gguf_tok.bos_id] + hf.encode(doc).ids
        plain = gguf_tok.encode(doc, add_special=False)
        assert gguf_tok.decode(plain) == doc
    print(f"tokenizer: {len(ours)} tokens on the corpus ({len(text) / len(ours):.2f} chars/token),"
          f" identical to HF")


# =============================================================================================
# 3. The model
# =============================================================================================

def encode_docs(tok, docs: list[str]) -> list[np.ndarray]:
    """BOS + document + EOS, cut to the context length."""
    out = []
    for d in docs:
        ids = tok.encode(d, add_special=True, parse_special=True) + [tok.eos_id]
        out.append(np.asarray(ids[:CONTEXT + 1], np.int64))
    return out


def pack_windows(seqs: list[np.ndarray], rng: np.random.Generator):
    """Greedily pack whole documents (shuffled) into windows of at most CONTEXT+1 tokens."""
    windows, cur, used = [], [], 0
    for i in rng.permutation(len(seqs)):
        s = seqs[i]
        if used + len(s) > CONTEXT + 1 and cur:
            windows.append(cur)
            cur, used = [], 0
        cur.append(s)
        used += len(s)
    if cur:
        windows.append(cur)
    return [pack([(s[:-1], s[1:]) for s in w]) for w in windows]


def train_model(model_path: Path, tok, docs: list[str], out_path: Path, steps: int,
                bench: bool = False) -> dict:
    model = load_model(model_path)
    rng = np.random.default_rng(TRAIN_SEED)
    order = rng.permutation(len(docs))
    n_val = int(len(docs) * TRAIN["val_docs"])
    val_seqs = encode_docs(tok, [docs[i] for i in order[:n_val]])
    train_seqs = encode_docs(tok, [docs[i] for i in order[n_val:]])
    val_batches = pack_windows(val_seqs, np.random.default_rng(0))[:48]
    n_train_tokens = sum(len(s) - 1 for s in train_seqs)
    print(f"model: {sum(a.size for a in map(model.gguf.array, model.gguf.tensors)) / 1e6:.2f} M "
          f"params; train {len(train_seqs)} docs ({n_train_tokens} tokens), "
          f"validation {n_val} docs ({sum(int((b.labels >= 0).sum()) for b in val_batches)} tokens "
          f"in {len(val_batches)} windows)")
    cfg = TrainConfig(mode="full", optimizer="adamw", lr=TRAIN["lr"], min_lr=TRAIN["min_lr"],
                      schedule="cosine", warmup_steps=min(TRAIN["warmup"], steps), max_steps=steps,
                      beta2=0.99, max_grad_norm=1.0, weight_decay=0.0, seed=TRAIN_SEED)
    session = TrainSession(model, cfg)
    uniform = math.log(model.config.n_vocab)
    print(f"uniform loss ln({model.config.n_vocab}) = {uniform:.3f}; "
          f"initial validation loss {session.evaluate(val_batches[:8])[0]:.3f}")
    k = TRAIN["windows_per_step"]
    epoch, queue, t0, tokens_done, history = 0, [], time.perf_counter(), 0, []
    for step in range(1, steps + 1):
        while len(queue) < k:
            queue += pack_windows(train_seqs, np.random.default_rng(TRAIN_SEED + epoch))
            epoch += 1
        batch, queue = queue[:k], queue[k:]
        m = session.step(batch)
        tokens_done += m.tokens
        if step % 10 == 0 or step == 1 or bench:
            el = time.perf_counter() - t0
            print(f"step {step:5d}/{steps} epoch {epoch} loss {m.loss:.3f} acc {m.accuracy:.3f} "
                  f"lr {m.lr:.2e} gnorm {m.grad_norm:.2f} {tokens_done / el:.0f} tok/s "
                  f"elapsed {el / 60:.1f} min", flush=True)
        if step % 200 == 0 or step == steps:
            vl, va = session.evaluate(val_batches)
            history.append((step, m.loss, vl))
            print(f"      validation loss {vl:.3f} acc {va:.3f}", flush=True)
    if bench:
        return {}
    tensors = {name: session.full[name] for name in model.gguf.tensors}
    meta = dict(model.metadata)
    write_gguf(out_path, meta, tensors, value_types=model.gguf.value_types)
    vl, va = session.evaluate(val_batches)
    return {"train_loss": history[-1][1], "val_loss": vl, "val_acc": va,
            "minutes": (time.perf_counter() - t0) / 60, "history": history}


def show_samples(path: Path) -> None:
    model = load_model(path)
    tok = model.tokenizer
    prompts = ["Once upon a time, there was a girl named Mia.", "Tom had a red ball.",
               "One day, Lily went to the park.", "The sky is", "Let's count: 5, 6,",
               chatml([{"role": "user", "content": "What is 23 + 45?"}]) + f"\n{IM_START}assistant\n",
               chatml([{"role": "user", "content": "What does a cow say?"}]) + f"\n{IM_START}assistant\n",
               chatml([{"role": "user", "content": "Tell me a story about Ben."}]) + f"\n{IM_START}assistant\n"]
    for p in prompts:
        ids = tok.encode(p, parse_special=True)
        out = list(model.generate(ids, max_new_tokens=60))
        print(f"--- {p!r}\n    -> {tok.decode(out)!r}")
    correct = 0
    for a, b in addition_prompts()[:100]:
        ids = tok.encode(chatml([{"role": "user", "content": f"What is {a} + {b}?"}])
                         + f"\n{IM_START}assistant\n", parse_special=True)
        correct += tok.decode(list(model.generate(ids, max_new_tokens=6))).strip() == str(a + b)
    print(f"greedy exact match on 100 held-out GRPO additions: {correct}/100")


# =============================================================================================

def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-only", action="store_true", help="write the text files, no model")
    ap.add_argument("--bench", action="store_true", help="time 10 steps and stop")
    ap.add_argument("--steps", type=int, default=TRAIN["steps"])
    ap.add_argument("--out", type=Path, default=HERE / "tiny-moe.gguf")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    docs = build_corpus()
    (HERE / "corpus.txt").write_text("\n\n".join(docs) + "\n")
    print(f"corpus: {len(docs)} documents, {sum(len(d) for d in docs)} characters")
    chat, completions, additions = build_datasets(set(docs))
    write_jsonl(HERE / "chat.jsonl", chat)
    write_jsonl(HERE / "completions.jsonl", completions)
    write_jsonl(HERE / "addition.jsonl", additions)
    if args.data_only:
        return

    hf = train_tokenizer(docs)
    with tempfile.TemporaryDirectory() as tmp:
        vocab_path, init_path = Path(tmp) / "vocab.gguf", Path(tmp) / "init.gguf"
        write_gguf(vocab_path, tokenizer_metadata(hf), {})
        tok = load_tokenizer(vocab_path)
        check_tokenizer(hf, tok, docs)
        create_model(init_path, SPEC, vocab_path)
        result = train_model(init_path, tok, docs, args.out, 10 if args.bench else args.steps,
                             bench=args.bench)
    if args.bench:
        return
    print(f"final train loss {result['train_loss']:.3f}, validation loss {result['val_loss']:.3f} "
          f"(acc {result['val_acc']:.3f}); training {result['minutes']:.1f} min")
    show_samples(args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB) in "
          f"{(time.perf_counter() - t_start) / 60:.1f} min")


if __name__ == "__main__":
    main()
