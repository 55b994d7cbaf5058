"""TrainSession: what trains, how steps accumulate, and that training actually learns."""

from __future__ import annotations

import numpy as np
import pytest

from app.engine import load_model
from app.engine.training.config import TrainConfig
from app.engine.errors import ConfigError
from app.engine.io.gguf import read_gguf
from app.engine.model.lora import adapter_norms, load_adapter, save_adapter
from app.engine.model.transformer import Model
from app.engine.data.batches import Batch, pack
from app.engine.training.session import TrainSession
from app.engine.model.weights import RowView
from tests.conftest import GOLDEN

TEXT = b"the quick brown fox jumps over the lazy dog. " * 6


def _text_batch(text=TEXT) -> Batch:
    ids = np.frombuffer(text, np.uint8).astype(np.int64)  # golden vocab: id == byte
    return pack([(ids[:-1], ids[1:])])


def test_full_finetuning_memorises_repetitive_text():
    model = load_model(GOLDEN / "mixtral-f32.gguf")
    session = TrainSession(model, TrainConfig(mode="full", lr=1e-2, max_steps=50))
    batch = _text_batch()
    first = session.step([batch]).loss
    for _ in range(49):
        last = session.step([batch])
    assert first > 5.0 and last.loss < 0.05 and last.accuracy > 0.99


def test_lora_starts_at_the_base_model_and_learns():
    model = load_model(GOLDEN / "qwen2moe-q4_0.gguf")
    session = TrainSession(model, TrainConfig(mode="lora", lora_rank=8, lora_alpha=16, lr=2e-2,
                                              lora_targets=("attention", "experts", "router"),
                                              max_steps=30, precision="fp32"))
    batch = _text_batch()
    base_loss, _ = session.model.loss(model.params(), batch.tokens, batch.labels,
                                      positions=batch.positions, segments=batch.segments)
    metrics = [session.step([batch]) for _ in range(30)]
    assert metrics[0].loss == pytest.approx(base_loss, rel=1e-5)  # B = 0 at the start
    assert metrics[-1].loss < 0.6 * metrics[0].loss
    assert any("ffn_up_exps.weight.lora_b" in n for n in session.trainable)
    assert any("ffn_gate_inp.weight.lora_a" in n for n in session.trainable)


def test_quantized_tensors_stay_frozen_in_full_mode():
    model = load_model(GOLDEN / "olmoe-q8_0.gguf")
    session = TrainSession(model, TrainConfig(mode="full", lr=1e-3, max_steps=1))
    assert session.full and all(model.gguf.tensors[n].ggml_type == 0 for n in session.full)
    assert "blk.0.attn_q.weight" not in session.full       # Q8_0
    assert "blk.0.ffn_gate_inp.weight" in session.full     # router stays F32 in quantized files
    session.step([_text_batch()])


def test_hybrid_trains_lora_and_full_tensors_together():
    model = load_model(GOLDEN / "mixtral-q4_0.gguf")
    session = TrainSession(model, TrainConfig(mode="hybrid", full_targets=("norms", "router"),
                                              lora_targets=("experts",), lr=1e-2, max_steps=2))
    before = {n: a.copy() for n, a in session.trainable.items()}
    session.step([_text_batch()])
    changed = {n for n, a in session.trainable.items() if not np.array_equal(a, before[n])}
    assert any(n.endswith("attn_norm.weight") for n in changed)
    assert any(n.endswith("ffn_gate_inp.weight") for n in changed)
    assert any(n.endswith("ffn_down_exps.weight.lora_b") for n in changed)


def test_accumulating_micro_batches_equals_one_packed_batch():
    """Two micro-batches give the same update as the same sequences packed in one batch."""
    model = load_model(GOLDEN / "deepseek-f32.gguf")
    ids = np.frombuffer(TEXT, np.uint8).astype(np.int64)
    s1, s2 = (ids[:40], ids[1:41]), (ids[50:70], ids[51:71])
    config = TrainConfig(mode="lora", lora_targets=("attention", "experts", "shared", "ffn"),
                         lr=1e-2, max_steps=1, precision="fp32")     # a float32 identity
    session = TrainSession(model, config)
    session.step([pack([s1, s2])])                    # make B non-zero so every grad is non-trivial
    loss_a, _, tokens_a, grads_a, _ = session._accumulate([pack([s1]), pack([s2])])
    loss_b, _, tokens_b, grads_b, _ = session._accumulate([pack([s1, s2])])
    assert tokens_a == tokens_b == 60 and loss_a == pytest.approx(loss_b, rel=1e-5)
    for name in grads_b:
        scale = np.abs(grads_b[name]).max()
        np.testing.assert_allclose(grads_a[name], grads_b[name], atol=1e-5 * scale, err_msg=name)


def test_packed_sequences_do_not_attend_across_boundaries():
    model = load_model(GOLDEN / "gemma3-f32.gguf")
    ids = np.frombuffer(TEXT, np.uint8).astype(np.int64)
    s1, s2 = (ids[:20], ids[1:21]), (ids[30:45], ids[31:46])
    params = model.params(training=True)
    alone = model.loss(params, s2[0], s2[1])[0]
    packed = pack([s1, s2])
    labels = packed.labels.copy()
    labels[:20] = -1                                   # score only the second sequence
    together = model.loss(params, packed.tokens, labels, positions=packed.positions,
                          segments=packed.segments)[0]
    assert together == pytest.approx(alone, rel=1e-5)


def test_token_weights_scale_the_loss():
    model = load_model(GOLDEN / "llama-f32.gguf")
    batch = _text_batch()
    params = model.params(training=True)
    plain = model.loss(params, batch.tokens, batch.labels)[0]
    weighted = model.loss(params, batch.tokens, batch.labels,
                          np.full(batch.tokens.size, 0.25, np.float32))[0]
    assert weighted == pytest.approx(0.25 * plain, rel=1e-5)


def test_bad_configs_are_config_errors():
    model = load_model(GOLDEN / "llama-q4_0.gguf")
    with pytest.raises(ConfigError):
        TrainSession(model, TrainConfig(mode="hybrid", full_targets=("attn_q",)))  # quantized
    with pytest.raises(ConfigError):
        TrainSession(model, TrainConfig(mode="lora", lora_targets=("experts",)))  # dense model
    with pytest.raises(ConfigError):
        TrainSession(model, TrainConfig(mode="lora", lora_targets=("nonsense",)))
    with pytest.raises(ConfigError):
        TrainConfig(mode="lora", lr=-1.0).validate()


def test_lora_dropout_is_reproducible_under_checkpointing():
    model = load_model(GOLDEN / "gemma3-f32.gguf")
    batch = _text_batch()
    runs = {}
    for interval in (0, 1):
        session = TrainSession(model, TrainConfig(mode="lora", lora_dropout=0.3, lr=1e-2,
                                                  checkpoint_interval=interval, max_steps=3))
        session.step([batch])                                   # B != 0 from here on
        runs[interval] = session._accumulate([batch])
    assert runs[0][0] == runs[1][0]
    for name, g in runs[0][3].items():
        np.testing.assert_array_equal(g, runs[1][3][name], err_msg=name)
    plain = TrainSession(model, TrainConfig(mode="lora", lr=1e-2, max_steps=3))
    plain.step([batch])
    assert plain._accumulate([batch])[0] != runs[0][0]          # dropout changes the loss
    loss_eval, _ = session.evaluate([batch])                    # evaluation has no dropout
    assert loss_eval == session.evaluate([batch])[0]


def test_head_over_the_cache_budget_is_read_by_row_slices():
    """With no room for a dequantized cache, the quantized head is dequantized chunk by chunk
    (never whole) and the loss is the same."""
    path = GOLDEN / "qwen2-q8_0.gguf"                                 # tied Q8_0 embedding head
    roomy, tight = load_model(path), Model(read_gguf(path), cache_budget=1024)
    assert isinstance(tight.params().row_view("token_embd.weight"), RowView)
    batch = _text_batch()
    losses = [m.loss_and_grads(m.params(training=True), batch.tokens, batch.labels,
                               vocab_chunk=64)[0] for m in (roomy, tight)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_adapter_norms_match_the_explicit_product():
    adapter = load_adapter(GOLDEN / "mixtral-lora.gguf")
    norms = adapter_norms(adapter, 0.5)
    for name, (a, b) in adapter.tensors.items():
        delta = 0.5 * adapter.scale(name) * (b @ a)                 # explicit, test only
        expect = np.linalg.norm(delta.reshape(-1, *delta.shape[-2:]), axis=(1, 2))
        np.testing.assert_allclose(norms[name]["delta"], expect, rtol=1e-5)
        assert len(norms[name]["a"]) == (a.shape[0] if a.ndim == 3 else 1)


def test_routing_counts_are_reported_per_moe_layer():
    model = load_model(GOLDEN / "deepseek-f32.gguf")                # layer 0 is dense
    batch = _text_batch()
    _, stats, _ = model.loss_and_grads(model.params(training=True), batch.tokens, batch.labels,
                                       checkpoint_interval=1)
    assert list(stats["routing"]) == [1]
    assert stats["routing"][1].sum() == batch.tokens.size * model.config.n_expert_used


def test_saved_adapter_reads_back_with_the_same_logits(tmp_path):
    model = load_model(GOLDEN / "olmoe-q8_0.gguf")
    session = TrainSession(model, TrainConfig(mode="lora", lora_targets=("attention", "experts",
                                                                         "router"), lr=1e-2))
    for _ in range(3):
        session.step([_text_batch()])
    save_adapter(session.adapter, tmp_path / "a.gguf")
    again = load_adapter(tmp_path / "a.gguf")
    assert again.arch == "olmoe" and again.alpha == session.adapter.alpha
    tokens = _text_batch().tokens[:20]
    np.testing.assert_array_equal(model.logits(tokens, again), model.logits(tokens, session.adapter))


def test_token_embedding_adapter_on_a_tied_model_adapts_the_lookup_only():
    model = load_model(GOLDEN / "qwen2-f32.gguf")                      # tied output head
    session = TrainSession(model, TrainConfig(mode="lora", lora_targets=("attention", "embeddings"),
                                              lr=1e-2))
    assert "token_embd.weight.lora_a" in session.trainable
    batch = _text_batch()
    base = model.logits(batch.tokens[:10])
    np.testing.assert_array_equal(model.logits(batch.tokens[:10], session.adapter), base)  # A = 0
    for _ in range(2):
        session.step([batch])                                        # trains without a crash
    assert np.abs(session.adapter.tensors["token_embd.weight"][0]).max() > 0
    assert np.abs(model.logits(batch.tokens[:10], session.adapter) - base).max() > 1e-4
