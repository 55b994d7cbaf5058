"""The bundled sample model (sample_data/tiny-moe.gguf): a real, pretrained tiny MoE.

It was pretrained by the workbench on sample_data/corpus.txt (sample_data/build_sample_model.py),
so it must load as a llama MoE, tokenize the corpus, continue corpus text recognisably, and
both full fine-tuning and LoRA must lower the validation loss on sample_data/chat.jsonl.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re

import numpy as np
import pytest

from app.engine import load_model
from app.engine.text.chat_template import render_chat
from app.engine.training.config import TrainConfig
from app.engine.data.batches import pack
from app.engine.training.session import TrainSession
from tests.conftest import SAMPLE_DATA

SAMPLE = SAMPLE_DATA
MODEL = SAMPLE / "tiny-moe.gguf"


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def corpus_words() -> set[str]:
    return set(re.findall(r"[A-Za-z]+", (SAMPLE / "corpus.txt").read_text()))


@pytest.fixture(scope="module")
def generator():
    """The corpus generator of the build script, to draw fresh (held-out) documents."""
    spec = importlib.util.spec_from_file_location("build_sample_model", SAMPLE / "build_sample_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _greedy(model, prompt: str, n: int = 40) -> str:
    tok = model.tokenizer
    ids = tok.encode(prompt, parse_special=True)
    return tok.decode(list(model.generate(ids, max_new_tokens=n)))


def _chat_prompt(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def test_bundled_model_is_a_small_llama_moe(model):
    cfg = model.config
    assert cfg.arch == "llama" and cfg.n_expert == 8 and cfg.n_expert_used == 2
    assert cfg.context_length == 256
    assert MODEL.stat().st_size < 20_000_000
    n_params = sum(int(np.prod(shape)) for shape in model.tensor_shapes.values())
    assert 3_000_000 < n_params < 5_000_000
    tok = model.tokenizer
    assert tok.add_bos and tok.bos_id is not None and tok.eos_id is not None
    assert "<|im_start|>" in tok.chat_template
    assert tok.token_to_piece(tok.bos_id) == "<|bos|>"
    assert {tok.eos_id, *tok.encode("<|im_end|>", add_special=False, parse_special=True)} <= tok.eot_ids


def test_tokenizer_round_trips_the_corpus(model):
    tok = model.tokenizer
    docs = (SAMPLE / "corpus.txt").read_text().split("\n\n")
    for doc in docs[:50]:
        ids = tok.encode(doc, parse_special=True)
        assert ids[0] == tok.bos_id
        assert tok.decode(ids, skip_special=False)[len("<|bos|>"):] == doc
    chat = next(d for d in docs if d.startswith("<|im_start|>"))
    ids = tok.encode(chat, add_special=False, parse_special=True)
    assert ids.count(tok.encode("<|im_start|>", add_special=False, parse_special=True)[0]) >= 2
    assert tok.encode("47 + 38", add_special=False) == [tok.encode(c, add_special=False)[0]
                                                         for c in ["4", "7", " +", " ", "3", "8"]]


def test_greedy_continuations_follow_the_corpus(model, corpus_words):
    story = ("Mia had a red ball. One day, she took the ball to the park. "
             "She played with the ball all morning. Then the ball was")
    out = _greedy(model, story, 30)
    assert out.startswith(" gone!")
    assert set(re.findall(r"[A-Za-z]+", out)) <= corpus_words
    out = _greedy(model, "Once upon a time, there was a boy named Tom. He had", 30)
    assert set(re.findall(r"[A-Za-z]+", out)) <= corpus_words and len(out.split()) >= 10
    assert _greedy(model, _chat_prompt("What does a cow say?"), 12) == "A cow says moo."
    assert _greedy(model, _chat_prompt("Count to 5."), 20) == "1, 2, 3, 4, 5."
    answer = _greedy(model, _chat_prompt("What is 47 + 38?"), 6)
    assert re.fullmatch(r"\d{2,3}", answer), answer   # a number, right or not (GRPO's job)


def test_validation_loss_is_far_below_uniform(model, generator):
    gen = generator.Gen(seed=2024)
    tok = model.tokenizer
    seqs = []
    for _ in range(12):
        ids = tok.encode(gen.document(), parse_special=True) + [tok.eos_id]
        seqs.append((ids[:-1], ids[1:]))
    batch = pack(seqs)
    loss, _ = model.loss(model.params(), batch.tokens, batch.labels, positions=batch.positions,
                         segments=batch.segments)
    assert loss < 1.5 < 0.25 * math.log(model.config.n_vocab)


def _chat_batches(model, rows, per_batch: int):
    tok = model.tokenizer
    seqs = []
    for row in rows:
        text = render_chat(tok.chat_template, row["messages"])
        ids = tok.encode(text, parse_special=True)
        seqs.append((ids[:-1], ids[1:]))
    return [pack(seqs[i:i + per_batch]) for i in range(0, len(seqs), per_batch)]


@pytest.mark.parametrize("config", [
    TrainConfig(mode="full", lr=1e-3, schedule="constant", max_steps=10),
    TrainConfig(mode="lora", lora_rank=8, lora_alpha=16, lr=1e-2, max_steps=10,
                lora_targets=("attention", "experts")),
], ids=["full", "lora"])
def test_fine_tuning_on_sample_chats_lowers_validation_loss(model, config):
    rows = [json.loads(line) for line in (SAMPLE / "chat.jsonl").read_text().splitlines()]
    assert 200 <= len(rows) <= 500
    train = _chat_batches(model, rows[:200], 8)
    held_out = _chat_batches(model, rows[-40:], 20)
    session = TrainSession(model, config)
    before, _ = session.evaluate(held_out)
    for step in range(10):
        session.step([train[step % len(train)]])
    after, _ = session.evaluate(held_out)
    assert after < 0.8 * before, (before, after)
