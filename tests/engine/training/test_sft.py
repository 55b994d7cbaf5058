"""The training run loop: events, checkpoints, exact pause/resume, extension, NaN, early stop."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from app.engine.training.checkpoints import list_checkpoints
from app.engine.training.config import TrainConfig
from app.engine.data.dataset import DataConfig
from app.engine.errors import CheckpointError, OutOfMemoryError
from app.engine.io.gguf import read_gguf, write_gguf
from app.engine.runs.queue import JobQueue
from app.engine.runs.reporter import RunReporter
from app.engine.model.lora import load_adapter
from app.engine.training.sft import RunConfig, TrainingDiverged, train
from app.engine.runs.rundir import RunDir
from app.engine.training import events as schema
from app.engine.training.session import TrainSession
from app.engine.runs.worker import run_worker
from tests.conftest import GOLDEN, REPO


@pytest.fixture
def data_file(tmp_path):
    rows = [{"text": f"Expert {i % 4} routes token {i}; the router learns."} for i in range(40)]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _config(data_file, **kw):
    train_cfg = TrainConfig(mode="lora", lr=1e-2, lora_targets=("attention", "experts", "router"),
                            lora_dropout=0.1, schedule=kw.pop("schedule", "cosine"),
                            warmup_fraction=kw.pop("warmup_fraction", 0.05))
    return RunConfig(model=str(GOLDEN / "mixtral-q8_0.gguf"), data=str(data_file), train=train_cfg,
                     data_config=DataConfig(context=48, val_fraction=0.2), epochs=2,
                     norms_every=3, eval_every=4, **kw)


def _steps(events):
    return [e["loss"] for e in events if e["type"] == "step"]


def test_run_reports_learns_and_saves(tmp_path, data_file):
    events = []
    assert train(_config(data_file), events.append, lambda: None, tmp_path / "ck") == "done"
    kinds = [e["type"] for e in events]
    assert kinds[1] == "start" and kinds[-1] == "done"
    assert {"step", "eval", "norms", "routing", "checkpoint"} <= set(kinds)
    losses = _steps(events)
    assert len(losses) == events[1]["total_steps"] and np.mean(losses[-5:]) < np.mean(losses[:5])
    routing = next(e for e in events if e["type"] == "routing")
    assert all(abs(sum(v) - 1.0) < 1e-6 for v in routing["layers"].values())
    norms = next(e for e in events if e["type"] == "norms")["tensors"]
    assert len(norms["blk.0.ffn_up_exps.weight"]["delta"]) == 4          # per expert
    assert load_adapter(tmp_path / "adapter.gguf").arch == "llama"


@pytest.mark.parametrize("pause_after", [1, 5, 9])
def test_pause_and_resume_is_bit_identical(tmp_path, data_file, pause_after):
    straight = []
    train(_config(data_file), straight.append, lambda: None, tmp_path / "a")
    first, calls = [], {"n": 0}

    def pause_once():
        calls["n"] += 1
        return "pause" if calls["n"] == pause_after else None
    assert train(_config(data_file), first.append, pause_once, tmp_path / "b") == "paused"
    resumed = []
    assert train(_config(data_file), resumed.append, lambda: None, tmp_path / "b") == "done"
    assert _steps(first) + _steps(resumed) == _steps(straight)


def test_extend_a_finished_run_by_an_epoch(tmp_path, data_file):
    two = []
    # a constant rate without warmup: the schedule does not depend on the run's length
    constant = dict(schedule="constant", warmup_fraction=0.0)
    train(_config(data_file, **constant), two.append, lambda: None, tmp_path / "a")
    one = dataclasses.replace(_config(data_file, **constant), epochs=1)
    first, more = [], []
    train(one, first.append, lambda: None, tmp_path / "b")
    train(dataclasses.replace(one, epochs=2), more.append, lambda: None, tmp_path / "b")
    assert _steps(first) + _steps(more) == _steps(two)


def test_non_finite_steps_stop_the_run(tmp_path, data_file, monkeypatch):
    real_step = TrainSession.step

    def nan_step(self, micro):
        m = real_step(self, micro)
        return dataclasses.replace(m, loss=float("nan"), skipped=True)
    monkeypatch.setattr(TrainSession, "step", nan_step)
    with pytest.raises(TrainingDiverged, match="NaN/Inf for 5 steps"):
        train(_config(data_file), lambda e: None, lambda: None, tmp_path / "ck")


def test_early_stopping_keeps_the_best_checkpoint(tmp_path, data_file, monkeypatch):
    losses = iter([3.0, 2.0, 2.5, 2.6, 2.7])
    monkeypatch.setattr(TrainSession, "evaluate", lambda self, b: (next(losses), 0.5))
    events = []
    config = dataclasses.replace(_config(data_file), eval_every=2, patience=2, keep_last=1)
    train(config, events.append, lambda: None, tmp_path / "ck")
    done = events[-1]
    assert done["reason"] == "early_stop" and done["best_step"] == 4
    assert (tmp_path / "ck" / "step-4").is_dir()                       # the best is kept


def test_worker_runs_a_real_training_job(tmp_path, data_file):
    config = dataclasses.replace(_config(data_file), epochs=1)
    run_dir = RunDir.create(tmp_path / "run", config.to_dict())
    queue = JobQueue(tmp_path / "q.sqlite3")
    job = queue.add(run_dir.path)
    assert run_worker(queue, once=True, poll_s=0.01) == 1
    assert queue.get(job).state == "done"
    assert (tmp_path / "run" / "adapter.gguf").exists()
    assert RunConfig.from_dict(run_dir.config()) == config
    assert any(e["type"] == "eval" for e in run_dir.metrics())


def test_out_of_memory_is_a_clear_error(tmp_path, data_file, monkeypatch):
    def no_memory(self, micro):
        raise MemoryError
    monkeypatch.setattr(TrainSession, "step", no_memory)
    with pytest.raises(OutOfMemoryError, match="at step 1") as err:
        train(_config(data_file), lambda e: None, lambda: None, tmp_path / "ck")
    assert "checkpoint" in err.value.hint


def queue_and_kill_worker(run_dir, queue_path, n_steps: int) -> list[dict]:
    """Queue the run, start a worker process and kill it with SIGKILL once the run has recorded
    `n_steps` steps (or after 120 s); the step events recorded by then."""
    JobQueue(queue_path).add(run_dir.path)
    worker = subprocess.Popen([sys.executable, "-m", "app", "queue", "worker", "--queue",
                               str(queue_path)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, cwd=REPO)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        steps = [e for e in run_dir.metrics() if e["type"] == "step"]
        if len(steps) >= n_steps:
            break
        time.sleep(0.02)
    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=30)
    return steps


def test_kill_9_mid_run_then_resume_gives_the_uninterrupted_losses(tmp_path, data_file):
    """A worker process killed with SIGKILL mid-training: the next worker recovers the job,
    resumes from the newest complete checkpoint, and every step's loss equals a run that was
    never interrupted."""
    config = dataclasses.replace(_config(data_file), save_every=2)
    straight = []
    train(config, straight.append, lambda: None, tmp_path / "straight")
    run_dir = RunDir.create(tmp_path / "run", config.to_dict())
    queue_path = tmp_path / "q.sqlite3"
    steps = queue_and_kill_worker(run_dir, queue_path, 7)  # a checkpoint and more steps
    assert 7 <= len(steps) < len(_steps(straight)), "the worker finished before the kill"
    assert run_worker(JobQueue(queue_path), once=True, poll_s=0.01, stale_after_s=0) == 1
    job = JobQueue(queue_path).list()[0]
    assert job.state == "done" and job.attempts == 1
    by_step = {e["step"]: e["loss"] for e in run_dir.metrics() if e["type"] == "step"}
    assert [by_step[i + 1] for i in range(len(by_step))] == _steps(straight)


def test_every_recorded_event_fits_the_schema(tmp_path, data_file):
    """A run paused and resumed, recorded as the worker and the CLI record it: every event of
    metrics.jsonl is one of the schema's, with exactly its fields."""
    run = RunDir.create(tmp_path / "run", _config(data_file).to_dict())
    assert train(_config(data_file), RunReporter(run).report, _pause_after(5),
                 run.checkpoints_dir) == "paused"
    assert train(_config(data_file), RunReporter(run).report, lambda: None,
                 run.checkpoints_dir) == "done"
    recorded = run.metrics()
    assert {e["type"] for e in recorded} == set(schema.SCHEMAS[schema.SFT_RUN])
    assert [schema.problems(e) for e in recorded] == [[]] * len(recorded)
    assert set(schema.STATUS_FIELDS) - set(run.status()) == {"reward_mean"}   # a GRPO field


def test_an_event_with_a_missing_or_unknown_field_is_refused():
    with pytest.raises(ValueError, match="a step event: missing .*unknown lost"):
        schema.SFT_STEP(step=1, lost=2)
    assert schema.LOG_EVENT(message="hi") == {"type": "log", "message": "hi"}
    assert schema.problems({"type": "samples", "step": 1, "items": []}) == [
        "'samples' is not an event of sft runs"]
    assert schema.problems({"type": "checkpoint", "step": 2, "tag": "", "time": 1.0}) == []


# ---------------------------------------------------------------------------- damaged checkpoints


def _pause_after(n):
    calls = {"n": 0}

    def should_stop():
        calls["n"] += 1
        return "pause" if calls["n"] == n else None
    return should_stop


def _truncate(path):
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])


def _flip(path, offset=-100):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


DAMAGES = {"truncate": (lambda ck: _truncate(ck / "arrays.npz"),
                        "arrays.npz does not match its checksum"),
           "flip": (lambda ck: _flip(ck / "arrays.npz"), "arrays.npz does not match its checksum"),
           "delete": (lambda ck: (ck / "meta.json").unlink(), "meta.json is missing")}


def _paused_run(tmp_path, data_file, name):
    """A run paused after 5 steps: checkpoints step-4 (saved every 2 steps) and step-5."""
    config = dataclasses.replace(_config(data_file), save_every=2)
    events = []
    assert train(config, events.append, _pause_after(5), tmp_path / name / "ck") == "paused"
    assert [p.name for p in list_checkpoints(tmp_path / name / "ck")] == ["step-4", "step-5"]
    return config, events


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one(tmp_path, data_file, damage):
    config, first = _paused_run(tmp_path, data_file, "run")
    straight = []
    train(config, straight.append, lambda: None, tmp_path / "straight" / "ck")
    ck = tmp_path / "run" / "ck"
    spoil, reason = DAMAGES[damage]
    spoil(ck / "step-5")
    resumed = []
    assert train(config, resumed.append, lambda: None, ck) == "done"
    logs = [e["message"] for e in resumed if e["type"] == "log"]
    assert (f"checkpoint step-5 is damaged ({reason}); resuming from step-4 "
            "(kept as step-5.damaged)") in logs
    assert "resumed from step 4" in logs and (ck / "step-5.damaged").is_dir()
    assert _steps(first)[:4] + _steps(resumed) == _steps(straight)
    assert ((tmp_path / "run" / "adapter.gguf").read_bytes()
            == (tmp_path / "straight" / "adapter.gguf").read_bytes())


def test_no_intact_checkpoint_is_a_clear_error(tmp_path, data_file):
    config, _ = _paused_run(tmp_path, data_file, "run")
    ck = tmp_path / "run" / "ck"
    _flip(ck / "step-5" / "meta.json", 10)
    _truncate(ck / "step-4" / "arrays.npz")
    with pytest.raises(CheckpointError, match="No checkpoint of the run is intact: step-5 is "
                       r"damaged \(meta.json does not match its checksum\); step-4 is damaged "
                       r"\(arrays.npz does not match its checksum\)") as err:
        train(config, lambda e: None, lambda: None, ck)
    assert f"workbench train --config {tmp_path / 'run' / 'config.json'}" in err.value.hint
    assert [p.name for p in list_checkpoints(ck)] == ["step-4", "step-5"]   # left as they were


def test_a_run_from_before_checksums_resumes_exactly(tmp_path, data_file):
    config, first = _paused_run(tmp_path, data_file, "run")
    straight, resumed = [], []
    train(config, straight.append, lambda: None, tmp_path / "straight" / "ck")
    for ck in list_checkpoints(tmp_path / "run" / "ck"):     # as written before checksums
        meta = json.loads((ck / "meta.json").read_text())
        del meta["format"]
        (ck / "meta.json").write_text(json.dumps(meta))
        (ck / "manifest.json").unlink()
    assert train(config, resumed.append, lambda: None, tmp_path / "run" / "ck") == "done"
    assert _steps(first) + _steps(resumed) == _steps(straight)


def test_nan_weights_fail_the_run_naming_the_tensor(tmp_path):
    """A NaN in one embedding row: only the steps whose windows hold that token are skipped,
    never 5 in a row, so the run used to finish with a quarter of its steps skipped."""
    src = read_gguf(GOLDEN / "llama-f32.gguf")
    tensors = {n: src.array(n).copy() for n in src.tensors}
    tensors["token_embd.weight"][ord("Z"), 3] = np.nan            # byte-level vocabulary
    write_gguf(tmp_path / "nan.gguf", dict(src.metadata), tensors, value_types=src.value_types)
    rows = [{"text": ("Zed " if i % 4 == 0 else "") + f"Expert {i % 4} routes token {i}."}
            for i in range(40)]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    config = RunConfig(model=str(tmp_path / "nan.gguf"), data=str(data),
                       train=TrainConfig(lora_targets=("attention",)),
                       data_config=DataConfig(context=32, val_fraction=0.0), epochs=1)
    with pytest.raises(TrainingDiverged, match="token_embd.weight hold NaN/Inf") as err:
        train(config, lambda e: None, lambda: None, tmp_path / "ck")
    assert "model file is damaged" in err.value.hint


@pytest.mark.parametrize("request_", ["cancel", "pause"])
def test_a_stop_request_while_reading_the_data_ends_the_run_at_once(tmp_path, request_):
    """A queue's cancel (or the worker's pause) reaches a run that is still reading its data:
    a 64 GB file without a line end (sparse: no disk) would take minutes to hash and read."""
    import time
    data = tmp_path / "zeros.jsonl"
    with open(data, "wb") as f:
        f.truncate(64 << 30)
    asked = []

    def should_stop():
        asked.append(time.monotonic())
        return request_
    t0 = time.monotonic()
    events = []
    try:
        assert train(_config(data), events.append, should_stop, tmp_path / "ck") == (
            "cancelled" if request_ == "cancel" else "paused")
    finally:
        data.unlink()
    assert time.monotonic() - t0 < 30 and len(asked) == 1
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def test_tokenizing_reports_its_progress_as_log_events(tmp_path, data_file, monkeypatch):
    """The CLI prints log events and the window's log shows them: a long tokenization says
    how far it is (at most every PROGRESS_EVERY_S seconds; 0 here: after every block)."""
    from app.engine.training import sft
    monkeypatch.setattr(sft, "PROGRESS_EVERY_S", 0.0)
    with open(data_file, "a") as f:     # a content of its own: not in the dataset cache
        f.write(json.dumps({"text": f"a row of {tmp_path.name} alone"}) + "\n")
    events = []
    train(dataclasses.replace(_config(data_file), max_steps=1, epochs=0), events.append,
          lambda: None, tmp_path / "ck")
    size = data_file.stat().st_size
    logs = [e["message"] for e in events if e["type"] == "log"]
    assert f"tokenizing data.jsonl: 41 rows, {size / 2**20:.0f} of {size / 2**20:.0f} MB" in logs
