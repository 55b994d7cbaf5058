"""RunReporter: what a queued job and a foreground run record (metrics.jsonl, status.json)."""

from __future__ import annotations

from app.engine.errors import DatasetError
from app.engine.runs.reporter import RunReporter, failure
from app.engine.runs.rundir import RunDir
from app.engine.training.events import LOG_EVENT


def _step(step, total=3, **extra):
    return {"type": "step", "step": step, "total_steps": total, "loss": 1.0 / step,
            "tokens": 99, **extra}


def test_step_events_reach_the_status_throttled(tmp_path):
    run = RunDir.create(tmp_path / "run", {})
    reporter = RunReporter(run, status_every_s=3600)
    reporter.started(job_id=7)
    st = run.status()
    assert st["state"] == "running" and st["job_id"] == 7 and st["error"] is None
    assert st["finished_at"] is None and st["started_at"] > 0
    reporter.report(_step(1))                                  # the first write is not held
    reporter.report(_step(2))                                  # held back by the throttle
    reporter.report(LOG_EVENT(message="hello"))                # not a step: status untouched
    assert run.status()["step"] == 1 and "tokens" not in run.status()   # not a status field
    reporter.flush_status()
    assert run.status()["step"] == 2
    reporter.report(_step(3))                                  # the last step: at once
    assert run.status()["step"] == 3 and run.status()["loss"] == 1.0 / 3
    assert [e["type"] for e in run.metrics()] == ["step", "step", "log", "step"]
    assert all("time" in e for e in run.metrics())


def test_finished_writes_the_held_back_step_and_the_outcome(tmp_path):
    run = RunDir.create(tmp_path / "run", {})
    reporter = RunReporter(run, status_every_s=3600)
    reporter.started()
    reporter.report(_step(1))
    reporter.report(_step(2))
    reporter.finished("paused")
    st = run.status()
    assert st["state"] == "paused" and st["step"] == 2 and st["finished_at"] is None
    error = failure(DatasetError("No rows.", "Check the file."))
    reporter.finished("failed", error)
    st = run.status()
    assert st["error"] == {"kind": "dataset", "message": "No rows.", "hint": "Check the file."}
    assert st["state"] == "failed" and st["finished_at"] >= st["started_at"]


def test_failure_names_the_kind_of_error():
    assert failure(MemoryError())["kind"] == "out_of_memory"
    bug = failure(KeyError("x"))
    assert bug["kind"] == "bug" and "KeyError" in bug["message"] and "report" in bug["hint"]
    assert "KeyError" in bug["detail"]


def test_log_txt_tells_the_runs_story_in_order(tmp_path):
    """The readable events (log, start, checkpoint, done) reach log.txt as they are recorded,
    between the lines others write there (the worker's 'job N: started'), never after them."""
    from app.engine.training.events import CHECKPOINT_EVENT, describe
    run = RunDir.create(tmp_path / "run", {})
    reporter = RunReporter(run)
    run.log("job 1: started by worker w1")
    reporter.report(LOG_EVENT(message="tokenizing chat.jsonl"))
    reporter.report(_step(1))                                        # a curve: not in the log
    reporter.report(CHECKPOINT_EVENT(step=1, tag="best"))
    reporter.report({"type": "done", "step": 1, "reason": "finished", "best_loss": 1.25,
                     "best_step": 1})
    run.log("job 1: done")
    lines = [line.split(" ", 2)[2] for line in run.log_path.read_text().splitlines()]
    assert lines == ["job 1: started by worker w1", "tokenizing chat.jsonl",
                     "checkpoint at step 1 (best)",
                     "done at step 1: finished, best validation loss 1.2500 at step 1",
                     "job 1: done"]
    assert describe({"type": "step", "step": 1}) is None
