"""A run in the foreground (`workbench train`, `workbench grpo`) and the same run queued and run
by the worker record the same: status.json with the same fields (the job's own aside) and
values, metrics.jsonl with the same events (kinds, fields, values; times aside)."""

from __future__ import annotations

import json

import pytest

from app.cli.main import run_cli
from app.cli.resume import RESUME
from app.engine.runs.kinds import KINDS
from app.engine.runs.queue import JobQueue
from app.engine.runs.rundir import RunDir
from app.engine.runs.worker import run_worker
from app.engine.training import events as schema
from tests.conftest import GOLDEN, SAMPLE_DATA

JOB_FIELDS = {"job_id", "worker_id", "attempts"}   # a queued run's status also names its job
TIMED = {"time", "updated_at", "writer", "started_at", "finished_at", "elapsed_s", "eta_s",
         "tokens_per_s", "rss_mb", "sample_s", "reward_s", "update_s", "step_s",
         "sample_tokens_per_s", "eval_s"}


def _untimed(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in TIMED}


def _both_ways(tmp_path, capsys, args) -> tuple[RunDir, RunDir]:
    """The run of `args` in the foreground, and queued then run by the worker."""
    assert run_cli(args + ["-o", str(tmp_path / "here")]) == 0
    queue = tmp_path / "q.sqlite3"
    assert run_cli(args + ["-o", str(tmp_path / "queued"), "--queue", str(queue)]) == 0
    assert run_worker(JobQueue(queue), once=True, poll_s=0.01) == 1
    capsys.readouterr()
    return RunDir(tmp_path / "here"), RunDir(tmp_path / "queued")


def _same_records(here: RunDir, queued: RunDir, run_kind: str) -> None:
    st, job_st = here.status(), queued.status()
    assert st["state"] == job_st["state"] == "done"
    assert set(st) == set(job_st) - JOB_FIELDS
    assert _untimed(st) == {k: v for k, v in _untimed(job_st).items() if k not in JOB_FIELDS}
    assert set(schema.STATUS_FIELDS) & set(st)                   # the steps reached the status
    recorded, job_recorded = here.metrics(), queued.metrics()
    assert [_untimed(e) for e in recorded] == [_untimed(e) for e in job_recorded]
    assert [sorted(e) for e in recorded] == [sorted(e) for e in job_recorded]
    assert all(schema.problems(e, run_kind) == [] for e in recorded)


def test_a_supervised_run_records_the_same_here_and_queued(tmp_path, capsys):
    rows = [{"text": f"Expert {i % 4} routes token {i}; the router learns."} for i in range(30)]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    here, queued = _both_ways(tmp_path, capsys, [
        "train", "-m", str(GOLDEN / "mixtral-q8_0.gguf"), "-d", str(data), "--ctx", "48",
        "--val-split", "0.2", "--epochs", "1", "--eval-every", "4", "--rank", "4",
        "--targets", "attn,experts,router", "--lr", "1e-2"])
    _same_records(here, queued, schema.SFT_RUN)


def test_a_grpo_run_records_the_same_here_and_queued(tmp_path, capsys):
    here, queued = _both_ways(tmp_path, capsys, [
        "grpo", "-m", str(SAMPLE_DATA / "tiny-moe.gguf"), "--prompts",
        str(SAMPLE_DATA / "addition.jsonl"), "--reward", "exact", "-G", "2", "-P", "2", "-n", "3",
        "--max-steps", "3", "--val-split", "0.03", "--samples-every", "1", "--save-every", "2",
        "--rank", "4", "--targets", "attn,experts,router"])
    _same_records(here, queued, schema.GRPO_RUN)


def test_a_failed_foreground_run_records_its_error_as_a_job_does(tmp_path, capsys,
                                                                 monkeypatch):
    """A run that fails after its first step keeps its folder, the error in status.json (one
    that fails before it removes the folder: test_failed_before_training)."""
    from app.engine.errors import DatasetError
    from app.engine.training import sft

    def fails_after_a_step(config, report, should_stop, checkpoints, **kw):
        report({"type": "step", "step": 1, "total_steps": 2})
        raise DatasetError("The data went bad.", "Fix it.")

    monkeypatch.setattr(sft, "train", fails_after_a_step)
    assert run_cli(["train", "-m", str(SAMPLE_DATA / "tiny-moe.gguf"), "-d",
                    str(SAMPLE_DATA / "chat.jsonl"), "--json", "-o", str(tmp_path / "run")]) == 2
    st = RunDir(tmp_path / "run").status()
    assert st["state"] == "failed" and set(st["error"]) == {"kind", "message", "hint"}
    assert st["error"]["kind"] == "dataset" and st["finished_at"] >= st["started_at"]


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_run_kind_can_be_resumed(name):
    assert name in RESUME
