"""A queued job and its input files (issue 28, points 5 and 7): a cancel reaches a job that is
still reading its data within seconds (the reader asks, the worker need not force it), and a job
resumed on changed data fails with the message `workbench resume` gives."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import time

from app.engine.data.dataset import DataConfig
from app.engine.runs.kinds import run_job
from app.engine.runs.queue import JobQueue
from app.engine.runs.rundir import RunDir
from app.engine.runs.worker import run_worker
from app.engine.training.sft import RunConfig
from tests.conftest import SAMPLE_DATA


def _run(tmp_path, data, **kw) -> RunDir:
    config = RunConfig(model=str(SAMPLE_DATA / "tiny-moe.gguf"), data=str(data),
                       data_config=DataConfig(context=64), **kw)
    return RunDir.create(tmp_path / "run", config.to_dict())


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.05)


def test_a_cancel_reaches_a_job_reading_its_data_within_seconds(tmp_path):
    data = tmp_path / "zeros.jsonl"
    with open(data, "wb") as f:     # 64 GB without a line end (sparse: no disk)
        f.truncate(64 << 30)
    run = _run(tmp_path, data)
    q = JobQueue(tmp_path / "q.sqlite3")
    job = q.add(run.path)
    stop = threading.Event()
    # grace_s 60: the worker's forced interrupt stays out of it; the reader must hear the cancel
    t = threading.Thread(target=run_worker, args=(q,), kwargs=dict(
        runner=run_job, stop_event=stop, poll_s=0.05, grace_s=60.0), daemon=True)
    t.start()
    try:
        _wait(lambda: run.metrics_path.exists() and "tokenizing" in run.metrics_path.read_text(),
              60, "the job to read its data")
        q.cancel(job)
        asked = time.monotonic()
        _wait(lambda: q.get(job).state == "cancelled", 20, "the job to be cancelled")
        assert time.monotonic() - asked < 10      # before: it read 64 GB (or was forced at 60 s)
    finally:
        stop.set()
        t.join(60)
        data.unlink()


def test_a_job_resumed_on_a_swapped_dataset_fails_naming_it(tmp_path):
    data = tmp_path / "data.jsonl"
    shutil.copy(SAMPLE_DATA / "chat.jsonl", data)
    run = _run(tmp_path, data, max_steps=2, epochs=0, save_every=1)
    q = JobQueue(tmp_path / "q.sqlite3")
    first = q.add(run.path)
    run_worker(q, runner=run_job, once=True)
    assert q.get(first).state == "done"
    config = RunConfig.from_dict(run.config())
    run.write_config(dataclasses.replace(config, max_steps=4).to_dict())
    data.write_text("".join(reversed(data.read_text().splitlines(keepends=True))))
    second = q.add(run.path)
    run_worker(q, runner=run_job, once=True)
    job = q.get(second)
    assert job.state == "failed"
    assert (f"The run's input changed since its checkpoint of step 2: the dataset {data} "
            "(content)") in job.error["message"]
    status = json.loads(run.status_path.read_text())
    assert status["state"] == "failed" and status["error"]["kind"] == "input_changed"
