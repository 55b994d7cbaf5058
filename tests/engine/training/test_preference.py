"""Preference training (DPO/IPO/hinge, ORPO, SimPO, KTO): formulas, exact gradients, runs.

* Each loss equals an independent float64 implementation of TRL's formula (written here from
  trl/trainer/dpo_trainer.py dpo_loss, orpo_trainer.py odds_ratio_loss, cpo_trainer.py
  cpo_loss loss_type="simpo", kto_trainer.py kto_loss) on the same log-probs, and its
  per-sequence derivatives equal central differences of it.
* Through a whole tiny model: the gradient the run's weighted step computes equals a float64
  finite difference of the loss with respect to LoRA A and B (1e-5 relative, as the model's
  own gradient checks).
* With B = 0 at the start the policy is the reference: the first DPO loss is ln 2.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from app.engine import load_adapter, load_model
from app.engine.data.preferences import PreferenceItem, Sequence
from app.engine.kernels.gradcheck import directional_check
from app.engine.training import preference_losses as L
from app.engine.training.config import TrainConfig
from app.engine.training.preference import (PreferenceConfig, problems, row_batch,
                                            sequence_grads, sequence_log_probs, train_preference,
                                            weighted_batches)
from tests.conftest import GOLDEN
from tests.engine.model.test_model_gradients import _lora_params

SAMPLE = "sample_data/tiny-moe.gguf"
PREFS = "sample_data/preferences.jsonl"


def _logps(seed=0, b=6):
    rng = np.random.default_rng(seed)
    n_c, n_r = rng.integers(2, 12, b).astype(float), rng.integers(2, 12, b).astype(float)
    pc, pr = -rng.uniform(0.2, 3, b) * n_c, -rng.uniform(0.2, 3, b) * n_r
    rc, rr = pc + rng.normal(0, 1, b), pr + rng.normal(0, 1, b)
    return pc, pr, rc, rr, n_c, n_r


# ---- float64 references of TRL's formulas ----------------------------------------------------------

def _ls(x):                               # F.logsigmoid
    return np.log(1.0 / (1.0 + np.exp(-x)))


def ref_dpo(pc, pr, rc, rr, nc, nr, beta, loss_type, eps, rpo):
    if loss_type == "ipo":                # TRL averages the log-probs for IPO
        pc, pr, rc, rr = pc / nc, pr / nr, rc / nc, rr / nr
    logits = (pc - pr) - (rc - rr)
    if loss_type == "sigmoid":
        losses = -_ls(beta * logits) * (1 - eps) - _ls(-beta * logits) * eps
    elif loss_type == "hinge":
        losses = np.maximum(0, 1 - beta * logits)
    else:
        losses = (logits - 1 / (2 * beta)) ** 2
    nll = -(pc * (nc if loss_type == "ipo" else 1)).sum() / nc.sum()
    return losses.mean() + rpo * nll, beta * (pc - rc), beta * (pr - rr)


def ref_orpo(pc, pr, nc, nr, lam):
    lc, lr = pc / nc, pr / nr
    log_odds = (lc - lr) - (np.log1p(-np.exp(lc)) - np.log1p(-np.exp(lr)))
    ratio = _ls(log_odds)
    return -pc.sum() / nc.sum() - (lam * ratio).mean(), ratio.mean(), log_odds.mean()


def ref_simpo(pc, pr, nc, nr, beta, gamma, eps, alpha):
    logits = (pc / nc - pr / nr) - gamma / beta
    losses = -_ls(beta * logits) * (1 - eps) - _ls(-beta * logits) * eps
    return losses.mean() + alpha * (-pc.sum() / nc.sum())


def ref_kto(p, r, labels, p_kl, r_kl, beta, wd, wu):
    kl = max(0.0, float((p_kl - r_kl).mean()))
    lr = p - r
    sig = lambda x: 1 / (1 + np.exp(-x))
    ch = 1 - sig(beta * (lr[labels] - kl))
    rj = 1 - sig(beta * (kl - lr[~labels]))
    return np.concatenate([wd * ch, wu * rj]).mean(), kl


def _fd(f, x, i, eps=1e-6):
    up, down = x.copy(), x.copy()
    up[i] += eps
    down[i] -= eps
    return (f(up) - f(down)) / (2 * eps)


@pytest.mark.parametrize("loss_type,eps,rpo", [("sigmoid", 0.0, 0.0), ("sigmoid", 0.1, 0.5),
                                               ("hinge", 0.0, 0.0), ("ipo", 0.0, 0.0),
                                               ("ipo", 0.0, 1.0)])
def test_dpo_matches_trl_and_its_derivatives(loss_type, eps, rpo):
    pc, pr, rc, rr, nc, nr = _logps(1)
    beta = 0.3
    out = L.dpo_loss(pc, pr, rc, rr, nc, nr, beta=beta, loss_type=loss_type,
                     label_smoothing=eps, sft_weight=rpo)
    want, rew_c, rew_r = ref_dpo(pc, pr, rc, rr, nc, nr, beta, loss_type, eps, rpo)
    assert out.loss == pytest.approx(want, rel=1e-12, abs=1e-14)
    assert out.metrics["rewards/margins"] == pytest.approx((rew_c - rew_r).mean(), rel=1e-12)
    assert out.metrics["rewards/accuracies"] == float((rew_c > rew_r).mean())
    for i in range(len(pc)):       # dL/dlogp of each sequence against central differences
        f_c = lambda x: L.dpo_loss(x, pr, rc, rr, nc, nr, beta=beta, loss_type=loss_type,
                                   label_smoothing=eps, sft_weight=rpo).loss
        f_r = lambda x: L.dpo_loss(pc, x, rc, rr, nc, nr, beta=beta, loss_type=loss_type,
                                   label_smoothing=eps, sft_weight=rpo).loss
        assert out.d_chosen[i] == pytest.approx(_fd(f_c, pc, i), rel=1e-6, abs=1e-9)
        assert out.d_rejected[i] == pytest.approx(_fd(f_r, pr, i), rel=1e-6, abs=1e-9)


def test_orpo_simpo_kto_match_trl_and_their_derivatives():
    pc, pr, rc, rr, nc, nr = _logps(2)
    out = L.orpo_loss(pc, pr, nc, nr, orpo_lambda=0.2)
    loss, ratio, log_odds = ref_orpo(pc, pr, nc, nr, 0.2)
    assert out.loss == pytest.approx(loss, rel=1e-12)
    assert out.metrics["log_odds_ratio"] == pytest.approx(ratio, rel=1e-12)
    assert out.metrics["log_odds_chosen"] == pytest.approx(log_odds, rel=1e-12)
    s = L.simpo_loss(pc, pr, nc, nr, beta=2.0, gamma=0.7, label_smoothing=0.05, sft_weight=0.3)
    assert s.loss == pytest.approx(ref_simpo(pc, pr, nc, nr, 2.0, 0.7, 0.05, 0.3), rel=1e-12)
    for i in range(len(pc)):
        assert out.d_chosen[i] == pytest.approx(
            _fd(lambda x: L.orpo_loss(x, pr, nc, nr, orpo_lambda=0.2).loss, pc, i), rel=1e-6)
        assert out.d_rejected[i] == pytest.approx(
            _fd(lambda x: L.orpo_loss(pc, x, nc, nr, orpo_lambda=0.2).loss, pr, i), rel=1e-6)
        f = lambda x: L.simpo_loss(pc, x, nc, nr, beta=2.0, gamma=0.7, label_smoothing=0.05,
                                   sft_weight=0.3).loss
        assert s.d_rejected[i] == pytest.approx(_fd(f, pr, i), rel=1e-6)
    labels = np.array([True, False, True, True, False, False])
    p_kl, r_kl = pc + 0.5, rc
    kl = L.kto_kl(p_kl, r_kl)
    k = L.kto_loss(pc, rc, labels, kl, beta=0.2, desirable_weight=1.5, undesirable_weight=0.7)
    want, want_kl = ref_kto(pc, rc, labels, p_kl, r_kl, 0.2, 1.5, 0.7)
    assert kl == pytest.approx(want_kl, rel=1e-12) and k.loss == pytest.approx(want, rel=1e-12)
    for i in range(len(pc)):       # the KL is a constant (TRL detaches it)
        f = lambda x: L.kto_loss(x, rc, labels, kl, beta=0.2, desirable_weight=1.5,
                                 undesirable_weight=0.7).loss
        assert k.d_chosen[i] == pytest.approx(_fd(f, pc, i), rel=1e-6)
    assert L.kto_kl(pc - 5, rc) == 0.0                              # clamped at 0
    r = 0.2 * (pc - rc)
    assert k.metrics["rewards/accuracies"] == float(np.mean(np.where(labels, r > 0, r < 0)))
    tie = L.kto_loss(pc, pc, labels, 0.0)                          # every reward 0: none right
    assert tie.metrics["rewards/accuracies"] == 0.0


# ---- exact gradients through a model ---------------------------------------------------------------

def _pairs(model, n=3, seed=0):
    rng = np.random.default_rng(seed)
    items = []
    for k in range(n):
        prompt = rng.integers(0, model.config.n_vocab, 4)
        seqs = []
        for _ in range(2):
            comp = rng.integers(0, model.config.n_vocab, int(rng.integers(2, 5)))
            ids = np.concatenate([prompt, comp]).astype(np.int32)
            trained = np.r_[np.zeros(len(prompt), bool), np.ones(len(comp), bool)]
            seqs.append(Sequence(ids, trained))
        items.append(PreferenceItem(k + 1, seqs[0], seqs[1], None, k))
    return items


LOSSES = {
    "dpo": lambda pol, ref, n: L.dpo_loss(pol[0::2], pol[1::2], ref[0::2], ref[1::2], n[0::2],
                                          n[1::2], beta=0.5, sft_weight=0.2),
    "ipo": lambda pol, ref, n: L.dpo_loss(pol[0::2], pol[1::2], ref[0::2], ref[1::2], n[0::2],
                                          n[1::2], beta=0.5, loss_type="ipo"),
    "orpo": lambda pol, ref, n: L.orpo_loss(pol[0::2], pol[1::2], n[0::2], n[1::2],
                                            orpo_lambda=0.5),
    "simpo": lambda pol, ref, n: L.simpo_loss(pol[0::2], pol[1::2], n[0::2], n[1::2], beta=2.0,
                                              gamma=0.5),
    "kto": lambda pol, ref, n: L.kto_loss(pol, ref, np.arange(len(pol)) % 3 == 0, 0.1,
                                          beta=0.5, undesirable_weight=1.3),
}


@pytest.mark.parametrize("method", list(LOSSES))
def test_loss_gradient_wrt_lora_a_and_b_is_exact(method):
    """The run's weighted step (weighted_batches + Model.loss_and_grads, two micro-batches
    combined as TrainSession combines them) against float64 central differences of the loss."""
    model = load_model(GOLDEN / "llama-f32.gguf")
    adapter = load_adapter(GOLDEN / "llama-lora.gguf")
    make, names, arrays = _lora_params(model, adapter)
    rb = row_batch(_pairs(model), "dpo", 64)
    base = model.params(None, dtype=np.float64)
    n = np.array([s.completion_tokens for s in rb.seqs], float)
    ref = sequence_log_probs(model, base, rb.seqs, 10_000, 8192)

    def loss_at(values):
        pol = sequence_log_probs(model, make(dict(zip(names, values))), rb.seqs, 10_000, 8192)
        return LOSSES[method](pol, ref, n).loss

    params = make(dict(zip(names, arrays)))
    out = LOSSES[method](sequence_log_probs(model, params, rb.seqs, 10_000, 8192), ref, n)
    batches = weighted_batches(rb.seqs, sequence_grads(out), max_tokens=20)
    assert len(batches) > 1
    total = sum(int((b.labels >= 0).sum()) for b in batches)
    grads = {}
    for b in batches:                   # TrainSession: sum of n_mb x grads / N
        _, stats, g = model.loss_and_grads(params, b.tokens, b.labels, b.token_weights,
                                           b.positions, b.segments)
        for k, v in g.items():
            grads[k] = grads.get(k, 0) + v * stats["n_tokens"] / total
    worst = 0.0
    for i, name in enumerate(names):
        only = [grads[name] if j == i else None for j in range(len(names))]
        worst = max(worst, directional_check(loss_at, arrays, only, seed=i))
    assert worst < 1e-5


def test_sequence_log_probs_are_the_logits_log_softmax():
    model = load_model(GOLDEN / "llama-f32.gguf")
    item = _pairs(model, 1)[0]
    got = sequence_log_probs(model, model.params(None, dtype=np.float64),
                             [item.chosen, item.rejected], 8, 8192)
    for s, g in zip((item.chosen, item.rejected), got):
        z = model.logits(s.ids[:-1], llamacpp_numerics=False).astype(np.float64)
        lp = z - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True)) \
            - z.max(1, keepdims=True)
        want = sum(lp[j - 1, s.ids[j]] for j in range(1, len(s.ids)) if s.trained[j])
        assert g == pytest.approx(want, rel=1e-5)   # float32 logits vs the float64 head


# ---- runs ---------------------------------------------------------------------------------------------

def _config(method="dpo", precision="auto", **kw):
    kw = {"max_steps": 4, "epochs": 0, "val_split": 0.1, "eval_every": 2, "save_every": 2,
          "pairs_per_step": 4, **kw}
    return PreferenceConfig(model=SAMPLE, data=PREFS, method=method,
                            train=TrainConfig(lr=3.5e-3, lora_rank=4, precision=precision), **kw)


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_first_dpo_step_is_ln2_and_events_fit_the_schema(tmp_path, precision):
    """The reference's base products are the policy's (bf16 or float32): with B = 0 the two
    forwards make the same calls, so the first loss is ln 2 exactly."""
    events = []
    assert train_preference(_config(precision=precision), events.append, lambda: None,
                            tmp_path / "ck") == "done"
    steps = [e for e in events if e["type"] == "step"]
    assert abs(steps[0]["loss"] - math.log(2)) < 1e-6     # B = 0: the policy is the reference
    assert steps[0]["rewards/margins"] == 0.0
    evals = [e for e in events if e["type"] == "eval"]
    assert [e["step"] for e in evals] == [0, 2, 4]
    assert evals[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    for e in events:
        assert problems(e, "dpo") == [], e
    json.dumps(events)
    assert load_adapter(tmp_path / "adapter.gguf").arch == "llama"


def _steps(evs, key):
    return [e[key] for e in evs if e["type"] == "step"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dpo", "orpo", "simpo", "kto"])
def test_pause_and_resume_is_exact(tmp_path, method):
    config = _config(method)
    straight = []
    train_preference(config, straight.append, lambda: None, tmp_path / "a")
    first, calls = [], {"n": 0}

    def pause_once():
        calls["n"] += 1
        return "pause" if calls["n"] == 3 else None
    assert train_preference(config, first.append, pause_once, tmp_path / "b") == "paused"
    resumed = []
    assert train_preference(config, resumed.append, lambda: None, tmp_path / "b") == "done"
    for key in ("loss", "rewards/margins", "grad_norm", "logps/chosen"):
        assert _steps(first, key) + _steps(resumed, key) == _steps(straight, key), key
    ev = lambda evs: [e["eval_rewards/margins"] for e in evs if e["type"] == "eval"]
    assert ev(first) + ev(resumed) == ev(straight)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dpo", "orpo", "simpo", "kto"])
def test_kill_9_mid_run_then_resume_gives_the_uninterrupted_steps(tmp_path, method):
    """A queue worker killed with SIGKILL mid-run (it finds the loop through the run-kind
    table): the next worker resumes from the newest checkpoint and every step's loss and
    margin equal those of a run never interrupted."""
    from app.engine.runs.queue import JobQueue
    from app.engine.runs.rundir import RunDir
    from app.engine.runs.worker import run_worker
    from tests.engine.training.test_sft import queue_and_kill_worker

    config = _config(method, max_steps=12, save_every=2, eval_every=4)
    straight = []
    train_preference(config, straight.append, lambda: None, tmp_path / "straight")
    run_dir = RunDir.create(tmp_path / "run", config.to_dict())
    queue_path = tmp_path / "q.sqlite3"
    steps = queue_and_kill_worker(run_dir, queue_path, 5)
    assert 5 <= len(steps) < 12, "the worker finished before the kill"
    assert run_worker(JobQueue(queue_path), once=True, poll_s=0.01, stale_after_s=0) == 1
    assert JobQueue(queue_path).list()[0].state == "done"
    recorded = run_dir.metrics()
    for key in ("loss", "rewards/margins"):
        by_step = {e["step"]: e[key] for e in recorded if e["type"] == "step"}
        assert [by_step[i + 1] for i in range(12)] == _steps(straight, key), key
    assert all(problems(e, method) == [] for e in recorded)
    assert run_dir.status()["eval_rewards/accuracies"] == [
        e for e in straight if e["type"] == "eval"][-1]["eval_rewards/accuracies"]


@pytest.mark.slow
def test_the_reference_is_the_starting_adapter_or_the_model_file(tmp_path):
    """--init-adapter: the adapter the run starts from is its reference (the first DPO loss is
    ln 2 although the adapter is not zero); full fine-tuning: the model file's weights."""
    first = []
    train_preference(_config(), first.append, lambda: None, tmp_path / "a" / "checkpoints")
    adapter = tmp_path / "a" / "adapter.gguf"
    assert any(np.abs(b).max() > 0 for _, b in load_adapter(adapter).tensors.values())
    for config, reference in ((_config(adapter=str(adapter), max_steps=1), "the starting adapter"),
                              (PreferenceConfig(model=SAMPLE, data=PREFS, max_steps=1, epochs=0,
                                                val_split=0.1, pairs_per_step=4,
                                                train=TrainConfig(mode="full", lr=1e-4)),
                               "the model file")):
        events = []
        train_preference(config, events.append, lambda: None)
        start = next(e for e in events if e["type"] == "start")
        step = next(e for e in events if e["type"] == "step")
        assert start["reference"] == reference
        assert step["loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert step["rewards/margins"] == 0.0
