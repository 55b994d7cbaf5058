"""Windows: context overflow, packing, padding, labels, positions, segments, batches per step."""

from __future__ import annotations

import json
from collections import Counter
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from app.engine import load_model
from app.engine.data import cache as data_cache
from app.engine.training.config import TrainConfig
from app.engine.data.dataset import DataConfig, load_dataset
from app.engine.data.batches import Batch
from app.engine.training.session import TrainSession
from app.engine.data.windows import (DROPPED, FITS, SPLIT, TRUNCATED, Sequences, build_batch, cut,
                                     plan_windows)
from tests.conftest import GOLDEN, VOCAB

VOCAB = VOCAB


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(data_cache.ENV_VAR, str(tmp_path / "cache"))


@lru_cache(maxsize=None)
def golden_model():
    return load_model(GOLDEN / "llama-f32.gguf")   # byte vocabulary: token = byte, BOS 256, EOS 257


def write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- cutting to the context ---------------------------------------------------------------------

def test_cut_fits_truncates_splits_drops():
    m = np.ones(10, bool)
    m[0] = False
    assert cut(m, 9, "truncate") == ([(0, 10)], FITS)       # 10 tokens = 9 positions: fits
    assert cut(m, 4, "truncate") == ([(0, 5)], TRUNCATED)
    assert cut(m, 4, "drop") == ([], DROPPED)
    pieces, status = cut(m, 4, "split")
    assert status == SPLIT and pieces == [(0, 5), (4, 9), (8, 10)]
    # every target token 1..9 is trained exactly once across the pieces
    targets = Counter(t for a, b in pieces for t in range(a + 1, b))
    assert sorted(targets) == list(range(1, 10)) and set(targets.values()) == {1}


def test_cut_leaves_out_pieces_without_targets():
    prompt_then_answer = np.array([False] * 8 + [True] * 3)
    assert cut(prompt_then_answer, 4, "truncate") == ([], DROPPED)   # the answer is cut off
    assert cut(prompt_then_answer, 4, "split") == ([(4, 9), (8, 11)], SPLIT)


# ---- packing ------------------------------------------------------------------------------------

def test_plan_windows_packs_every_piece_once_within_the_context():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, size=500)
    order = rng.permutation(500)
    windows = plan_windows(lengths, order, 64, "pack")
    flat = [i for w in windows for i in w]
    assert sorted(flat) == list(range(500))
    assert all(lengths[w].sum() <= 64 for w in windows)
    assert lengths.sum() / (64 * len(windows)) > 0.9                    # well filled
    assert [w for w in plan_windows(lengths, order, 64, "none")] == [[int(i)] for i in order]


def _seqs():
    ids = [np.array([256, 10, 11, 12, 257]), np.array([256, 20, 21, 257]), np.array([256, 30, 31])]
    masks = [np.array([0, 0, 1, 1, 1], bool), np.array([0, 1, 1, 1], bool), np.array([0, 1, 1], bool)]
    return Sequences.concat(ids, masks)


def test_build_batch_labels_positions_segments():
    seqs = _seqs()
    b = build_batch(seqs, [(0, 0, 5), (1, 0, 4)], None)
    assert isinstance(b, Batch)
    assert b.tokens.tolist() == [256, 10, 11, 12, 256, 20, 21]
    assert b.labels.tolist() == [-1, 11, 12, 257, 20, 21, 257]
    assert b.positions.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert b.segments.tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert b.token_weights is None
    w = build_batch(seqs, [(0, 0, 5), (1, 0, 4)], [0.5, 2.0])
    assert w.token_weights.tolist() == [0.5] * 4 + [2.0] * 3
    later = build_batch(seqs, [(0, 2, 5)], None)                          # a split piece
    assert later.tokens.tolist() == [11, 12] and later.labels.tolist() == [12, 257]
    assert later.positions.tolist() == [0, 1]


def test_pad_mode_pads_to_the_context_without_effect():
    seqs = _seqs()
    b = build_batch(seqs, [(2, 0, 3)], [3.0], pad_to=6, pad_id=257)
    assert b.tokens.tolist() == [256, 30, 257, 257, 257, 257]
    assert b.labels.tolist() == [30, 31, -1, -1, -1, -1]
    assert b.segments.tolist() == [0, 0, 1, 1, 1, 1]
    assert b.token_weights.tolist() == [3.0, 3.0, 0, 0, 0, 0]


# ---- a dataset's batches ------------------------------------------------------------------------

def _texts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"text": " ".join(["ab", "cde", "f", "ghij"][k] for k in rng.integers(0, 4, rng.integers(3, 40)))}
            for _ in range(n)]


def _targets(ds, epoch) -> Counter:
    """(row, token index) of every trained label in the epoch's windows."""
    out = Counter()
    for w in ds.train_windows(epoch):
        for row, a, b in w:
            mask = ds.train_file.seqs.mask(row)
            out.update((row, t) for t in range(a + 1, b) if mask[t])
    return out


@pytest.mark.parametrize("packing", ["pack", "pad", "none"])
@pytest.mark.parametrize("overflow", ["truncate", "split"])
def test_every_target_is_trained_once_per_epoch(tmp_path, packing, overflow):
    tok = golden_model().tokenizer
    ds = load_dataset(write(tmp_path / "t.jsonl", _texts(60)), tok,
                      DataConfig(context=48, packing=packing, overflow=overflow))
    expected = Counter()
    for row in range(len(ds.train_file.seqs)):
        mask = ds.train_file.seqs.mask(row)
        n = len(mask) if overflow == "split" else min(len(mask), 49)
        expected.update((row, t) for t in range(1, n) if mask[t])
    assert _targets(ds, 0) == expected and _targets(ds, 1) == expected
    label_count = 0
    for step in ds.train_batches(0):
        for b in step:
            assert len(b.tokens) <= 48 and (packing != "pad" or len(b.tokens) == 48)
            assert b.tokens.dtype == np.int64 and b.labels.dtype == np.int64
            # a label is the next token of the same segment, or -1
            same = b.segments[1:] == b.segments[:-1]
            inside = b.labels[:-1][same]
            assert np.all((inside == -1) | (inside == b.tokens[1:][same]))
            label_count += int((b.labels >= 0).sum())
    assert label_count == sum(expected.values())
    stats = ds.stats
    assert stats.train_targets == label_count
    assert (stats.truncated > 0) == (overflow == "truncate") and (stats.split > 0) == (overflow == "split")


def test_train_batches_group_micro_batches_and_resume(tmp_path):
    ds = load_dataset(write(tmp_path / "t.jsonl", _texts(50)), golden_model().tokenizer,
                      DataConfig(context=32, packing="none"))
    windows = len(ds.train_windows(2))
    steps = list(ds.train_batches(2, grad_accum=4))
    assert [len(s) for s in steps] == [4] * (windows // 4) + ([windows % 4] if windows % 4 else [])
    assert ds.steps_per_epoch(grad_accum=4, epoch=2) == len(steps)
    resumed = list(ds.train_batches(2, grad_accum=4, start_step=3))
    assert len(resumed) == len(steps) - 3
    for a, b in zip(steps[3:], resumed):
        assert all(np.array_equal(x.tokens, y.tokens) and np.array_equal(x.labels, y.labels)
                   for x, y in zip(a, b))


def test_packed_loss_equals_separate_losses(tmp_path):
    """Positions restart and segments isolate: packing changes nothing but the speed."""
    model = golden_model()
    params = model.params(training=True)
    ds = load_dataset(write(tmp_path / "t.jsonl", _texts(6, seed=3)), model.tokenizer,
                      DataConfig(context=1024, shuffle=False))
    (packed,) = [b for step in ds.train_batches(0) for b in step]
    assert len(np.unique(packed.segments)) == 6
    loss, stats = model.loss(params, packed.tokens, packed.labels, None, packed.positions,
                             packed.segments)
    alone = load_dataset(write(tmp_path / "a.jsonl", _texts(6, seed=3)), model.tokenizer,
                         DataConfig(context=1024, shuffle=False, packing="none"))
    total = count = 0.0
    for step in alone.train_batches(0):
        for b in step:
            l, s = model.loss(params, b.tokens, b.labels)
            total += l * s["n_tokens"]
            count += s["n_tokens"]
    assert count == stats["n_tokens"]
    assert loss == pytest.approx(total / count, rel=1e-5)


def test_a_training_step_runs_on_dataset_batches(tmp_path):
    model = golden_model()
    rows = [{"prompt": "2+2=", "completion": "4", "reward": r} for r in (1, 3, 2, 5)]
    ds = load_dataset(write(tmp_path / "c.jsonl", rows), model.tokenizer,
                      DataConfig(context=32, normalize="min-max"))
    session = TrainSession(model, TrainConfig(mode="lora", lora_rank=2, lr=1e-2, max_steps=2))
    step = next(ds.train_batches(0, grad_accum=2))
    metrics = session.step(step)
    assert np.isfinite(metrics.loss) and metrics.tokens == ds.stats.train_targets
    val_loss, _ = session.evaluate(ds.val_batches() or step)
    assert np.isfinite(val_loss)


def test_epochs_have_the_same_windows_in_a_new_order(tmp_path):
    ds = load_dataset(write(tmp_path / "t.jsonl", _texts(80)), golden_model().tokenizer,
                      DataConfig(context=64))
    e0, e1 = ds.train_windows(0), ds.train_windows(1)
    assert e0 != e1 and sorted(e0) == sorted(e1)
    assert ds.steps_per_epoch(3, epoch=0) == ds.steps_per_epoch(3, epoch=5) == -(-len(e0) // 3)
    assert ds.stats.fill > 0.85 and ds.stats.windows_per_epoch == len(e0)
