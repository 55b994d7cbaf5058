"""Batched decoding (Model.generate_batch) against one-by-one Model.generate and Model.logits."""

from __future__ import annotations

import numpy as np
import pytest

from app.engine import load_adapter, load_model
from app.engine.model import generation
from tests.conftest import GOLDEN, GOLDEN_MODELS

# different lengths, each prompt three times (a group of samples sharing its prefill)
PROMPTS = [p for p in ([5, 17, 99, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [7])
           for _ in range(3)]
SEEDS = list(range(100, 100 + len(PROMPTS)))


@pytest.mark.parametrize("name", GOLDEN_MODELS)
@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 0.9), (1.5, 1.0)])
def test_batch_gives_each_sequence_what_generate_gives_it_alone(name, temperature, top_p):
    model = load_model(GOLDEN / f"{name}-f32.gguf")
    batch = model.generate_batch(PROMPTS, 10, temperature, top_p, SEEDS, stop=[])
    alone = [list(model.generate(p, 10, temperature, top_p, s, stop=[]))
             for p, s in zip(PROMPTS, SEEDS)]
    assert batch == alone
    assert all(len(ids) == 10 for ids in batch)
    if temperature > 0:
        assert len({tuple(ids) for ids in batch[:3]}) > 1      # samples of one prompt differ


@pytest.mark.parametrize("name", ["mixtral", "gemma3"])
def test_batch_with_an_adapter(name):
    model = load_model(GOLDEN / f"{name}-f32.gguf")
    adapter = load_adapter(GOLDEN / f"{name}-lora.gguf")
    batch = model.generate_batch(PROMPTS, 8, 1.0, 1.0, SEEDS, adapter, 0.5, stop=[])
    assert batch == [list(model.generate(p, 8, 1.0, 1.0, s, adapter, 0.5, stop=[]))
                     for p, s in zip(PROMPTS, SEEDS)]
    assert batch != model.generate_batch(PROMPTS, 8, 1.0, 1.0, SEEDS, stop=[])


# gemma3's GELU is ggml's fp16 table: round-off that moves an input across an fp16 rounding
# boundary changes its output by an fp16 step, a few 1e-4 in the logits (2e-6 with exact GELU)
@pytest.mark.parametrize("name, tol", [("llama", 1e-5), ("mixtral", 1e-5), ("qwen2moe", 1e-5),
                                       ("gemma3", 1e-3)])
def test_batched_step_logits_match_the_full_forward(name, tol, monkeypatch):
    """Every decoding step's logits of every sequence (prefill packed, then the batched padded
    cache; gemma3's window is 4) equal Model.logits of its prompt and tokens so far."""
    model = load_model(GOLDEN / f"{name}-f32.gguf")
    stop = {model.generate_batch(PROMPTS, 9, 1.0, 1.0, SEEDS, stop=[])[0][2]}  # ends some early
    seen = []                                  # the logits each sample_token call gets, in order
    sample = generation.sample_token
    monkeypatch.setattr(generation, "sample_token", lambda z, *a: seen.append(z) or sample(z, *a))
    sequences = [list(p) for p in PROMPTS]
    n_checked = 0
    for rows, tokens in generation._decode(model, PROMPTS, 9, 1.0, 1.0, SEEDS, None, 1.0, stop):
        assert len(seen) == len(rows)
        for b, z, token in zip(rows, seen, tokens):
            np.testing.assert_allclose(z, model.logits(sequences[b])[-1], rtol=tol, atol=tol)
            sequences[b].append(int(token))
            n_checked += 1
        seen.clear()
    assert n_checked > len(PROMPTS) * 3


def test_stop_tokens_end_sequences_which_leave_the_batch():
    model = load_model(GOLDEN / "mixtral-f32.gguf")
    free = model.generate_batch(PROMPTS, 10, 1.0, 1.0, SEEDS, stop=[])
    stop = free[0][3]
    batch = model.generate_batch(PROMPTS, 10, 1.0, 1.0, SEEDS, stop=[stop])
    for ids, full, p, s in zip(batch, free, PROMPTS, SEEDS):
        end = full.index(stop) + 1 if stop in full else len(full)
        assert ids == full[:end]                            # the stop token kept, last
        alone = list(model.generate(p, 10, 1.0, 1.0, s, stop=[stop]))
        assert alone == [t for t in ids if t != stop]       # generate leaves it out
    assert len(batch[0]) == 4 and any(len(ids) == 10 for ids in batch)
    # default stop: the tokenizer's end-of-turn ids
    assert model.generate_batch(PROMPTS, 10, 0.0) == model.generate_batch(
        PROMPTS, 10, 0.0, stop=model.tokenizer.eot_ids)


def test_context_length_and_edge_cases():
    model = load_model(GOLDEN / "llama-f32.gguf")
    n_ctx = model.config.context_length
    near = list(np.arange(n_ctx - 2) % 200)
    full = list(np.arange(n_ctx) % 200)
    out = model.generate_batch([near, [1, 2], full], 5, stop=[])
    assert [len(ids) for ids in out] == [2, 5, 0]
    assert out[0] == list(model.generate(near, 5, stop=[]))
    assert list(model.generate(full, 5, stop=[])) == []
    assert model.generate_batch([], 5) == []
    assert model.generate_batch([[1, 2]], 0) == [[]]
    with pytest.raises(ValueError, match="one per prompt"):
        model.generate_batch([[1], [2]], 3, 1.0, seeds=[1])
