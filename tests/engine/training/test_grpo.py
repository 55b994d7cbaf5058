"""GRPO-style runs: advantages, the update is the GRPO gradient, KL weights, events, resume, CLI."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from app.cli.main import run_cli
from app.engine import load_model
from app.engine.training.config import TrainConfig
from app.engine.errors import ConfigError
from app.engine.training.grpo import (GrpoConfig, compute_advantages, kl_weights, load_prompts,
                                      policy_batches, prompt_ids, sample_groups, sample_seed,
                                      step_prompts, token_log_probs, train_grpo)
from app.engine.runs import kinds
from app.engine.export.exporter import source_from_run
from app.engine.runs.queue import JobQueue
from app.engine.runs.reporter import RunReporter
from app.engine.model.lora import LoraAdapter, LoraConfig, init_adapter, load_adapter
from app.engine.training.reward_functions import RewardScorer, RewardSpec, trust_reward_files
from app.engine.runs.rundir import RunDir
from app.engine.text.tokenizer import Tokenizer
from app.engine.training import events as schema
from app.engine.training.session import TrainSession
from app.engine.runs.worker import run_worker
from tests.conftest import GOLDEN, SAMPLE_DATA

SAMPLE = SAMPLE_DATA
TINY = str(SAMPLE / "tiny-moe.gguf")
ADDITION = str(SAMPLE / "addition.jsonl")


# ---- advantages ------------------------------------------------------------------------------------

def test_group_std_advantages():
    r = np.array([[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.5, 1.5, 1.0, 1.0]])
    adv = compute_advantages(r, "group-std")
    mean, std = r.mean(1, keepdims=True), r.std(1, keepdims=True)     # ddof 0
    np.testing.assert_allclose(adv[[0, 2]], ((r - mean) / (std + 1e-6))[[0, 2]])
    assert (adv[1] == 0).all()                                          # zero spread: exactly 0
    np.testing.assert_allclose(adv[[0, 2]].mean(1), 0, atol=1e-12)
    np.testing.assert_allclose(adv[[0, 2]].std(1), 1, atol=1e-5)


def test_no_std_and_batch_std_advantages():
    r = np.array([[1.0, 0.0], [3.0, 3.0], [4.0, 0.0]])
    np.testing.assert_allclose(compute_advantages(r, "no-std"), [[0.5, -0.5], [0, 0], [2, -2]])
    np.testing.assert_allclose(compute_advantages(r, "batch-std"),
                               np.array([[0.5, -0.5], [0, 0], [2, -2]]) / (r.std() + 1e-6))


@pytest.mark.parametrize("mode", ["group-std", "no-std", "batch-std"])
def test_constant_rewards_give_zero_advantages_without_nan(mode):
    for r in (np.zeros((3, 4)), np.full((2, 8), 0.1), np.full((1, 2), -7.3)):
        adv = compute_advantages(r, mode)
        assert np.isfinite(adv).all() and (adv == 0).all()
    tiny = compute_advantages(np.array([[1.0, 1.0 + 1e-12]]), mode)    # nearly flat: finite
    assert np.isfinite(tiny).all()
    with pytest.raises(ConfigError):
        compute_advantages(np.zeros((2, 2)), "nope")


# ---- the update is the GRPO policy gradient ------------------------------------------------------------

def _tiny_policy(seed=1):
    """The golden Mixtral (2 layers, 4 experts) with a fresh LoRA whose B is random."""
    model = load_model(GOLDEN / "mixtral-f32.gguf")
    adapter = init_adapter(model.tensor_shapes, "llama",
                           LoraConfig(4, 8, ("attention", "experts", "router"), seed=seed))
    rng = np.random.default_rng(seed)
    for _, b in adapter.tensors.values():
        b[...] = rng.normal(0, 0.1, b.shape)
    return model, adapter


def _groups(rng, eot=257, P=3, G=3):
    """P prompts, G completions each (some end with the end-of-turn token, some are clipped)."""
    prompts = [list(rng.integers(0, 256, rng.integers(4, 9))) for _ in range(P)]
    completions = []
    for i in range(P * G):
        c = list(rng.integers(0, 256, rng.integers(2, 7)))
        completions.append(c + [eot] if i % 2 == 0 else c)
    return prompts, completions


def _with(adapter, values):
    out = LoraAdapter(adapter.alpha, {}, adapter.arch)
    for k, base in enumerate(adapter.tensors):
        out.tensors[base] = (values[2 * k], values[2 * k + 1])
    return out


def _logp(model, adapter, prompt, completion):
    """log pi of each completion token, independently: float64 log-softmax of Model.logits."""
    seq = np.array(prompt + completion)
    z = model.logits(seq[:-1], adapter).astype(np.float64)[len(prompt) - 1:]
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    return z[np.arange(len(completion)), completion] - lse


def _sgd_gradient(model, adapter, batches):
    """The gradient a real step applies: one SGD step with lr 1 moves the parameters by -grad."""
    session = TrainSession(model, TrainConfig(lora_rank=4, lora_alpha=8, optimizer="sgd", lr=1.0,
                                              max_grad_norm=0.0,   # the raw gradient
                                              lora_targets=("attention", "experts", "router"),
                                              precision="fp32"),   # a float32 gradient check
                           adapter)
    before = [np.array(x, np.float64) for pair in adapter.tensors.values() for x in pair]
    session.step(batches)
    after = [np.array(x, np.float64) for pair in adapter.tensors.values() for x in pair]
    return before, [b - a for b, a in zip(before, after)]


def _directional_error(objective, x, grads, seed=0, eps=3e-3):
    """Relative error between sum <g, d> and the central difference of the objective along
    d = unit(g) + unit(random), normalised (chainer's directional check; a purely random
    direction in ~10^4 dimensions sees too little of the gradient above Model.logits' float32
    rounding, the gradient's own direction alone could hide an error orthogonal to it)."""
    rng = np.random.default_rng(seed)
    unit = lambda vs: [v / np.sqrt(sum(float((w * w).sum()) for w in vs)) for v in vs]
    d = unit([a + b for a, b in zip(unit(grads), unit([rng.standard_normal(v.shape) for v in x]))])
    numeric = (objective([v + eps * w for v, w in zip(x, d)])
               - objective([v - eps * w for v, w in zip(x, d)])) / (2 * eps)
    analytic = sum(float((g * w).sum()) for g, w in zip(grads, d))
    return abs(numeric - analytic) / max(abs(numeric), abs(analytic))


def test_reward_weighted_step_is_the_grpo_gradient():
    model, adapter = _tiny_policy()
    prompts, completions = _groups(np.random.default_rng(0))
    rewards = np.array([[1.0, 0.0, 0.5], [1.0, 1.0, 1.0], [0.0, 2.0, 1.0]])   # one flat group
    adv = compute_advantages(rewards).reshape(-1)
    sequences = [(prompts[i // 3], c, np.full(len(c), adv[i])) for i, c in enumerate(completions)]
    batches = policy_batches(sequences, max_tokens=30)          # several micro-batches
    assert len(batches) > 1 and len(batches) < 9
    n_tokens = sum(len(c) for c in completions)                 # N: every completion token

    def J(values):  # the GRPO objective, -(1/N) sum_i A_i sum_t log pi(o_it)
        ad = _with(adapter, values)
        return -sum(a * _logp(model, ad, prompts[i // 3], c).sum()
                    for i, (c, a) in enumerate(zip(completions, adv))) / n_tokens

    x, grads = _sgd_gradient(model, adapter, batches)
    assert _directional_error(J, x, grads) < 1e-4

    # teeth: the end-of-turn token left out, or N counting only the trained sequences, fail
    cut = [(p, c[:-1] if c[-1] == 257 else c, w[:len(c) - (c[-1] == 257)])
           for p, c, w in sequences]
    _, bad = _sgd_gradient(*_tiny_policy(), policy_batches(cut))
    assert _directional_error(J, x, bad) > 1e-2
    kept = [s for s in sequences if s[2].any()]
    unscaled = policy_batches(kept)                             # loses the N_kept / N factor
    for b in unscaled:
        b.token_weights *= n_tokens / sum(len(c) for _, c, _ in kept)
    _, bad = _sgd_gradient(*_tiny_policy(), unscaled)
    assert _directional_error(J, x, bad) > 1e-2


def test_policy_batches_labels_and_weights():
    seqs = [([5, 6, 7], [8, 9, 3], np.array([0.5, 0.5, 0.5])),
            ([5, 6], [4, 3], np.zeros(2)),                      # zero advantage: left out
            ([1], [2, 2], np.array([-1.0, -2.0]))]
    [b] = policy_batches(seqs)
    assert b.tokens.tolist() == [5, 6, 7, 8, 9, 1, 2]
    assert b.labels.tolist() == [-1, -1, 8, 9, 3, 2, 2]
    scale = 5 / 7                                               # N_kept / N
    np.testing.assert_allclose(b.token_weights, np.array([0, 0, .5, .5, .5, -1, -2]) * scale,
                               rtol=1e-6)
    assert b.positions.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert b.segments.tolist() == [0, 0, 0, 0, 0, 1, 1]
    [only] = policy_batches([s for s in seqs if not s[2].any()])  # nothing to learn
    assert (only.token_weights == 0).all() and (only.labels >= 0).sum() == 2


def test_kl_weights_are_the_k3_gradient():
    beta = 0.3
    w, k3 = kl_weights(0.7, np.log([0.2, 0.5]), np.log([0.4, 0.5]), beta)
    np.testing.assert_allclose(w, [0.7 - beta * (1 - 2.0), 0.7])
    np.testing.assert_allclose(k3, [2.0 - np.log(2.0) - 1, 0.0], atol=1e-15)

    model, adapter = _tiny_policy(seed=2)
    prompts, completions = _groups(np.random.default_rng(3), P=2, G=2)
    adv = compute_advantages(np.array([[1.0, 0.0], [0.0, 0.0]])).reshape(-1)
    refs = [token_log_probs(model, prompts[i // 2], c, None) for i, c in enumerate(completions)]
    sequences = []
    for i, c in enumerate(completions):
        logp = token_log_probs(model, prompts[i // 2], c, adapter)
        sequences.append((prompts[i // 2], c, kl_weights(adv[i], logp, refs[i], beta)[0]))
    n_tokens = sum(len(c) for c in completions)

    def J(values):  # -(1/N) sum A log pi + (beta/N) sum k3(log pi_ref - log pi), ref fixed
        ad = _with(adapter, values)
        total = 0.0
        for i, c in enumerate(completions):
            logp = _logp(model, ad, prompts[i // 2], c)
            r = refs[i] - logp
            total += -adv[i] * logp.sum() + beta * (np.exp(r) - r - 1).sum()
        return total / n_tokens

    x, grads = _sgd_gradient(model, adapter, policy_batches(sequences))
    assert _directional_error(J, x, grads, seed=1) < 1e-4


# ---- prompts, sampling ------------------------------------------------------------------------------

def test_prompt_order_covers_every_row_once_per_epoch():
    steps = [step_prompts(10, s, 4, seed=3) for s in range(5)]   # 20 prompts = 2 epochs
    flat = sum(steps, [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]                                 # reshuffled per epoch
    assert steps == [step_prompts(10, s, 4, seed=3) for s in range(5)]
    assert step_prompts(10, 0, 4, seed=4) != steps[0]


def test_prompts_chat_plain_and_rejected(tmp_path):
    model = load_model(TINY)
    rows = [{"messages": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"},
            {"prompt": "Let's count: 1, 2,", "answer": 3},
            {"prompt": "no answer"},
            {"messages": "bad"}]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{not json\n")
    with RewardScorer([RewardSpec("exact")]) as scorer:
        good, rejected, n = load_prompts(str(path), model.tokenizer, scorer, 200)
    assert n == 5 and [r.line for r in good] == [1, 2] and [r.line for r in rejected] == [3, 4, 5]
    tok = model.tokenizer
    assert tok.decode(list(good[0].ids)) == \
        "<|bos|><|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert good[0].text == "What is 2 + 3?" and good[1].ids[0] == tok.bos_id


def test_prompts_never_end_with_an_eos():
    model = load_model(TINY)
    tok = model.tokenizer
    adds_eos = Tokenizer.from_metadata({**model.metadata, "tokenizer.ggml.add_eos_token": True})
    assert adds_eos.encode("1, 2,")[-1] == adds_eos.eos_id
    for row in ({"messages": [{"role": "user", "content": "What is 2 + 3?"}]},
                {"prompt": "Let's count: 1, 2,"}):
        ids, _ = prompt_ids(adds_eos, row)
        assert ids == prompt_ids(tok, row)[0] and ids[0] == tok.bos_id and ids[-1] != tok.eos_id


def test_sampling_is_seeded_and_keeps_the_end_of_turn_token():
    model = load_model(TINY)
    with RewardScorer([RewardSpec("exact")]) as scorer:
        rows, _, _ = load_prompts(ADDITION, model.tokenizer, scorer, 200)
    eot = model.tokenizer.eot_ids
    config = _config(max_new_tokens=8, prompts_per_step=1)       # batches of G = 6 sequences
    runs = sample_groups(model, rows[:3], 6, None, config, 1, 0)
    assert [(c.prompt.index, c.sample) for c in runs] == [(i, j) for i in range(3) for j in range(6)]
    assert [c.ids for c in runs] == [c.ids for c in sample_groups(
        model, rows[:3], 6, None, _config(max_new_tokens=8, prompts_per_step=4), 1, 0)]
    assert len({tuple(c.ids) for c in runs[:6]}) > 1                # samples differ
    for c in runs:       # what Model.generate gives the prompt alone, up to its end of turn
        alone = list(model.generate(c.prompt.ids, 8, 1.0, 1.0,
                                    sample_seed(0, 1, c.prompt.index, c.sample), stop=()))
        assert c.ids == alone[:len(c.ids)] and not set(c.ids[:-1]) & eot
        assert c.finished == (c.ids[-1] in eot) and (c.finished or len(c.ids) == 8)
        assert c.text == model.tokenizer.decode(c.ids[:-1] if c.finished else c.ids)
    assert all(c.finished for c in runs[:6])
    clipped = sample_groups(model, rows[:1], 2, None, _config(max_new_tokens=2), 1, 0)
    assert [len(c.ids) for c in clipped] == [2, 2] and not any(c.finished for c in clipped)
    assert sample_seed(0, 1, 0, 0) != sample_seed(0, 2, 0, 0) != sample_seed(1, 1, 0, 0)


# ---- runs --------------------------------------------------------------------------------------------

def _config(**kw):
    base = dict(model=TINY, prompts=ADDITION, rewards=(RewardSpec("exact"),),
                train=TrainConfig(lora_rank=4, lora_alpha=8, lr=2e-3,
                                  lora_targets=("attention", "experts", "router")),
                group_size=3, prompts_per_step=2, max_new_tokens=5, max_steps=4, val_split=0.03,
                samples_every=2, norms_every=2, save_every=2)
    base.update(kw)
    return GrpoConfig(**base)


def _steps(events, key="reward_mean"):
    return [e[key] for e in events if e["type"] == "step"]


def test_run_events_and_outputs(tmp_path):
    events = []
    assert train_grpo(_config(eval_samples=2), events.append, lambda: None,
                      tmp_path / "ck") == "done"
    kinds = [e["type"] for e in events]
    assert kinds[0] == "start" and kinds[1] == "eval" and kinds[-1] == "done"
    assert {"step", "samples", "norms", "routing", "checkpoint", "eval"} <= set(kinds)
    start = events[0]
    assert start["kind"] == "grpo" and start["val_prompts"] == 6 and start["train_prompts"] == 194
    assert start["rewards"] == [{"name": "exact", "kind": "exact", "weight": 1.0}]
    step = next(e for e in events if e["type"] == "step")
    for key in ("loss", "lr", "grad_norm", "reward_mean", "reward_std", "zero_spread_fraction",
                "completion_len_mean", "completion_len_min", "completion_len_max",
                "completion_clipped_fraction", "advantage_mean", "sample_tokens_per_s", "eta_s"):
        assert isinstance(step[key], (int, float)), key
    assert set(step["rewards"]["exact"]) == {"mean", "std"} and step["kl"] is None
    assert 1 <= step["completion_len_min"] <= step["completion_len_max"] <= 5
    samples = next(e for e in events if e["type"] == "samples")
    assert samples["step"] == 2 and len(samples["items"]) == 2 * 3
    item = samples["items"][0]
    assert {"prompt", "completion", "reward", "rewards", "advantage", "answer", "length",
            "finished", "prompt_index", "line", "sample"} <= set(item)
    evals = [e for e in events if e["type"] == "eval"]
    assert [e["step"] for e in evals] == [0, 4] and evals[0]["prompts"] == 6
    assert 0 <= evals[-1]["rewards"]["exact"]["mean"] <= 1
    assert evals[0]["sampled"]["samples"] == 2 and set(evals[0]["sampled"]["rewards"]) == {"exact"}
    json.dumps(events)                                             # all JSON-able
    assert load_adapter(tmp_path / "adapter.gguf").arch == "llama"


@pytest.mark.parametrize("pause_after", [2])
def test_pause_and_resume_is_exact(tmp_path, pause_after):
    config = _config(kl=0.05, max_steps=4, val_split=0.0)
    straight = []
    train_grpo(config, straight.append, lambda: None, tmp_path / "a")
    first, calls = [], {"n": 0}

    def pause_once():
        calls["n"] += 1
        return "pause" if calls["n"] == pause_after else None
    assert train_grpo(config, first.append, pause_once, tmp_path / "b") == "paused"
    resumed = []
    assert train_grpo(config, resumed.append, lambda: None, tmp_path / "b") == "done"
    for key in ("reward_mean", "loss", "kl", "completion_len_mean", "grad_norm"):
        assert _steps(first, key) + _steps(resumed, key) == _steps(straight, key), key
    assert _steps(first, "step") + _steps(resumed, "step") == [1, 2, 3, 4]


def test_every_recorded_event_fits_the_schema(tmp_path):
    """A GRPO run paused and resumed, recorded as the worker and the CLI record it: every event
    of metrics.jsonl is one of the schema's for GRPO runs, with exactly its fields."""
    config = _config(eval_samples=2)
    run = RunDir.create(tmp_path / "run", config.to_dict())
    calls = iter([None, "pause"])
    assert train_grpo(config, RunReporter(run).report, lambda: next(calls, None),
                      run.checkpoints_dir) == "paused"
    assert train_grpo(config, RunReporter(run).report, lambda: None,
                      run.checkpoints_dir) == "done"
    recorded = run.metrics()
    assert {e["type"] for e in recorded} == set(schema.SCHEMAS[schema.GRPO_RUN])
    assert [schema.problems(e, schema.GRPO_RUN) for e in recorded] == [[]] * len(recorded)
    assert schema.problems(recorded[0]) == [                  # not an event of an SFT run
        "a start event of sft runs carries kind 'grpo', not None"]
    assert set(schema.STATUS_FIELDS) <= set(run.status())
    # the exporter reads the run's config by its kind
    assert source_from_run(run.path).model_path == config.model


def test_config_round_trip_and_validation():
    config = _config(rewards=(RewardSpec("exact", 2.0), RewardSpec("regex", 0.5, arg=r"^\d+$")))
    d = config.to_dict()
    assert d["kind"] == "grpo" and d["rewards"][1]["arg"] == r"^\d+$"
    assert GrpoConfig.from_dict(json.loads(json.dumps(d))) == config
    for bad in (dict(group_size=1), dict(advantage="x"), dict(rewards=()), dict(top_p=0.0),
                dict(train=TrainConfig(mode="full"))):
        with pytest.raises(ConfigError):
            _config(**bad).validate()
    with pytest.raises(ConfigError, match="epochs: unknown setting"):
        GrpoConfig.from_dict({**d, "epochs": 3})


def test_worker_runs_grpo_jobs_and_survives_a_broken_reward(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def reward(prompt, completion, **row):\n    return 1 / 0\n")
    untrusted = tmp_path / "untrusted.py"
    untrusted.write_text("def reward(prompt, completion, **row):\n    return 1\n")
    good = RunDir.create(tmp_path / "good", _config(max_steps=2, val_split=0.0).to_dict())
    bad_rewards = (RewardSpec("file", arg=str(broken)),)
    trust_reward_files(bad_rewards)                 # as the CLI or the window does on submit
    bad = RunDir.create(tmp_path / "bad", _config(rewards=bad_rewards).to_dict())
    foreign = RunDir.create(tmp_path / "foreign", _config(
        rewards=(RewardSpec("file", arg=str(untrusted)),)).to_dict())
    queue = JobQueue(tmp_path / "q.sqlite3")
    bad_id, foreign_id, good_id = queue.add(bad.path), queue.add(foreign.path), queue.add(good.path)
    assert run_worker(queue, once=True, poll_s=0.01) == 3
    failed = queue.get(bad_id)
    assert failed.state == "failed" and failed.error_kind == "reward"
    assert "ZeroDivisionError" in failed.error_message and "broken.py" in failed.error_message
    refused = queue.get(foreign_id)                 # not trusted: never runs
    assert refused.state == "failed" and refused.error_kind == "untrusted_reward"
    assert f"reward code from {untrusted}" in refused.error_message
    assert "--trust-reward-code" in refused.error_hint and not foreign.metrics()
    assert queue.get(good_id).state == "done" and (tmp_path / "good" / "adapter.gguf").exists()
    assert [e["step"] for e in good.metrics() if e["type"] == "step"] == [1, 2]


def test_sft_run_dirs_still_dispatch_to_the_sft_loop(tmp_path, monkeypatch):
    from app.engine.training import sft as run

    seen = []
    monkeypatch.setattr(run, "train", lambda config, *a, **k: seen.append(config) or "done")
    rows = tmp_path / "d.jsonl"
    rows.write_text('{"text": "hello"}\n')
    config = run.RunConfig(model=TINY, data=str(rows))
    for extra in ({}, {"kind": "sft"}):
        r = RunDir.create(tmp_path / f"r{len(seen)}", {**config.to_dict(), **extra})
        assert kinds.run_job(r, type("C", (), {"report": None, "should_stop": None})()) == "done"
    assert seen == [config, config]


# ---- the command line --------------------------------------------------------------------------------

def test_cli_grpo_run_and_resume(tmp_path, capsys):
    custom = tmp_path / "short.py"
    custom.write_text(textwrap.dedent("""
        def reward(prompt, completion, **row):
            return 1.0 if len(completion) <= 3 else 0.0
    """))
    out = tmp_path / "run"
    args = ["grpo", "-m", TINY, "--prompts", ADDITION, "--reward", "exact",
            "--reward", f"{custom}:0.5", "--reward", r"regex:^\d+$:0.1", "--group-size", "3",
            "--prompts-per-step", "2", "--max-new-tokens", "5", "--max-steps", "3",
            "--rank", "4", "--alpha", "8", "--targets", "attn,experts,router", "--lr", "1e-3",
            "--kl", "0.01", "--advantage", "no-std", "--samples-every", "1", "--seed", "7",
            "-o", str(out), "--json"]
    assert run_cli(args) == 0
    lines = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
    steps = [e for e in lines if e["type"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3]
    assert set(steps[0]["rewards"]) == {"exact", "short", "regex"} and steps[0]["kl"] >= 0
    config = json.loads((out / "config.json").read_text())
    assert config["kind"] == "grpo" and config["advantage"] == "no-std"
    assert config["rewards"][1] == {**RewardSpec("file", 0.5, arg=str(custom)).to_dict()}
    assert config["train"]["seed"] == 7 and config["group_size"] == 3
    assert RunDir(out).status()["state"] == "done"
    # resume a finished run: nothing left to do, it finishes again without new steps
    config["max_steps"] = 4
    (out / "config.json").write_text(json.dumps(config))
    assert run_cli(["grpo", "--resume", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "grpo: [████████] step     4/4 reward=" in printed
    assert "start  grpo: 4 steps of 2 prompts x 3 completions" in printed
    assert "; resumed at step 3" in printed


def test_cli_grpo_errors_and_queue(tmp_path, capsys):
    assert run_cli(["grpo", "-m", TINY, "--prompts", ADDITION, "-o", str(tmp_path / "a")]) == 2
    assert "at least one reward" in capsys.readouterr().err
    assert run_cli(["grpo", "-m", TINY, "--prompts", ADDITION, "--reward", "bogus",
                    "-o", str(tmp_path / "b")]) == 2
    assert "Unknown reward 'bogus'" in capsys.readouterr().err
    queue = tmp_path / "q.sqlite3"
    assert run_cli(["grpo", "-m", TINY, "--prompts", ADDITION, "--reward", "exact",
                    "-o", str(tmp_path / "c"), "--queue", str(queue)]) == 0
    [job] = JobQueue(queue).list()
    assert job.state == "queued" and json.loads(
        (tmp_path / "c" / "config.json").read_text())["kind"] == "grpo"


def test_cli_runs_reward_files_from_a_config_only_when_trusted(tmp_path, capsys):
    custom = tmp_path / "shared_reward.py"
    custom.write_text("def reward(prompt, completion, **row):\n    return len(completion)\n")
    shared = tmp_path / "shared.json"
    shared.write_text(json.dumps(_config(
        rewards=(RewardSpec("exact"), RewardSpec("file", 0.1, arg=str(custom))), max_steps=1,
        val_split=0.0).to_dict()))
    out = tmp_path / "run"
    assert run_cli(["grpo", "--config", str(shared), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"reward code from {custom}" in err and "--trust-reward-code" in err
    assert not out.exists()
    queue = tmp_path / "q.sqlite3"                  # nor queued without trust
    assert run_cli(["grpo", "--config", str(shared), "-o", str(out), "--queue", str(queue)]) == 2
    assert not out.exists()
    assert run_cli(["grpo", "--config", str(shared), "-o", str(out), "--trust-reward-code",
                    "--json"]) == 0
    assert [e["step"] for e in RunDir(out).metrics() if e["type"] == "step"] == [1]
    capsys.readouterr()
    assert run_cli(["resume", str(out)]) == 0       # the user's own run: no question again
    assert "reward code" not in capsys.readouterr().err
    with custom.open("a") as f:                     # changed after it was trusted: refused
        f.write("# edited\n")
    for args in (["resume", str(out)], ["grpo", "--resume", str(out)]):
        assert run_cli(args) == 2
        assert f"reward code from {custom}" in capsys.readouterr().err
    assert run_cli(["resume", str(out), "--trust-reward-code"]) == 0


def test_a_run_queued_with_trust_runs_in_the_worker(tmp_path):
    custom = tmp_path / "mine.py"
    custom.write_text("def reward(prompt, completion, **row):\n    return 1.0\n")
    queue = tmp_path / "q.sqlite3"
    assert run_cli(["grpo", "-m", TINY, "--prompts", ADDITION, "--reward", str(custom),
                    "-G", "2", "-P", "1", "-n", "2", "--max-steps", "1", "--save-every", "0",
                    "-o", str(tmp_path / "run"), "--queue", str(queue)]) == 0
    assert run_worker(JobQueue(queue), once=True, poll_s=0.01) == 1
    assert JobQueue(queue).list()[0].state == "done"
