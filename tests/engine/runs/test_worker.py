"""The worker: the runner contract, cancel/pause within one step, failures stored on the job,
two worker processes on one queue, recovery after kill -9, the detached worker and its lock.

Runners here are fakes that count steps and keep a "checkpoint" (the next step) in the run
directory, the way the real train loop resumes."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app.cli.main import run_cli
from app.engine.runs import worker as worker_mod
from app.engine.text.chat_template import render_chat
from app.engine.errors import Cancelled, ConfigError
from app.engine.runs.queue import JobQueue
from app.engine.runtime.processes import pid_alive
from app.engine.runs.rundir import RunDir
from app.engine.runtime.files import atomic_write_json, read_json
from app.engine.runs.worker import (JobControl, JobInterrupted, WorkerAlreadyRunning, WorkerLock,
                                    install_stop_signals, run_worker, start_worker_detached,
                                    worker_pid, worker_running)
from tests.conftest import REPO

ROOT = REPO
TIMEOUT = 30.0  # generous: only ever waited for in full when something is broken


def wait_for(cond, timeout=TIMEOUT, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def q(tmp_path) -> JobQueue:
    return JobQueue(tmp_path / "q.sqlite3")


def add_run(q, tmp_path, name: str, **config) -> int:
    return q.add(RunDir.create(tmp_path / "runs" / name, {"name": name, **config}).path)


# ---------------------------------------------------------------------------- fake runners


class StepRunner:
    """`n_steps` steps, resumable from `checkpoints/next.json`; `hooks[step](control)` runs
    before the step's should_stop (e.g. a GUI cancelling the job)."""

    def __init__(self, n_steps=20, step_s=0.0, hooks=None):
        self.n_steps, self.step_s, self.hooks = n_steps, step_s, hooks or {}
        self.steps: list[int] = []
        self.reached = {i: threading.Event() for i in range(n_steps + 1)}
        self.controls: list[JobControl] = []

    def __call__(self, run_dir: RunDir, control: JobControl):
        self.controls.append(control)
        ckpt = run_dir.checkpoints_dir / "next.json"
        start = read_json(ckpt)["step"] if ckpt.exists() else 0
        for step in range(start, self.n_steps):
            self.reached[step].set()
            if step in self.hooks:
                self.hooks[step](control)
            action = control.should_stop()
            if action == "pause":
                atomic_write_json(ckpt, {"step": step})
                return "paused"
            if action == "cancel":
                return "cancelled"
            time.sleep(self.step_s)
            self.steps.append(step)
            control.report({"step": step + 1, "total_steps": self.n_steps,
                            "loss": 1.0 / (step + 1), "eta_s": 0.1})
        self.reached[self.n_steps].set()
        return "done"


def recording_runner(run_dir: RunDir, control: JobControl):
    """For the two-process test: fails loudly (a DUPLICATE file) if a job runs twice."""
    out = Path(os.environ["WB_TEST_OUT"])
    try:
        os.close(os.open(out / f"job-{control.job.id}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        (out / f"DUPLICATE-{control.job.id}").touch()
    with open(out / f"ran-{os.getpid()}.txt", "a") as f:
        f.write(f"{control.job.id}\n")
    for step in range(3):
        if control.should_stop():
            return "cancelled"
        time.sleep(0.003)
        control.report({"step": step + 1, "loss": 1.0})
    return "done"


def slow_runner(run_dir: RunDir, control: JobControl):
    """For the kill -9 test: checkpoints every step, runs until killed."""
    ckpt = run_dir.checkpoints_dir / "next.json"
    start = read_json(ckpt)["step"] if ckpt.exists() else 0
    for step in range(start, 100_000):
        if control.should_stop():
            return "cancelled"
        atomic_write_json(ckpt, {"step": step + 1}, fsync=False)
        control.report({"step": step + 1, "loss": 1.0})
        if step == 5:
            (run_dir.path / "started").write_text(str(os.getpid()))
        time.sleep(0.01)
    return "done"


def spin(seconds: float = TIMEOUT) -> int:
    """Pure-Python work that never asks should_stop (a runaway template, a huge dataset);
    gives up after `seconds` so that a broken test does not spin forever."""
    n, give_up = 0, time.monotonic() + seconds
    while time.monotonic() < give_up:
        n += 1
    return n


def spinning_runner(run_dir: RunDir, control: JobControl):
    """Checkpoints step 7, then is stuck in Python until interrupted; a resumed run is done."""
    ckpt = run_dir.checkpoints_dir / "next.json"
    if ckpt.exists() and read_json(ckpt).get("resumed"):
        return "done"
    atomic_write_json(ckpt, {"step": 7})
    (run_dir.path / "started").write_text(str(os.getpid()))
    spin()
    return "done"


def _child() -> None:
    """Entry point of a worker process: `python -c "...; _child()" SPEC_JSON`."""
    spec = json.loads(sys.argv[1])
    os.environ["WB_TEST_OUT"] = spec["out"]
    out = Path(spec["out"])
    (out / f"ready-{os.getpid()}").touch()
    deadline = time.monotonic() + TIMEOUT
    while len(list(out.glob("ready-*"))) < spec.get("n_ready", 1) and time.monotonic() < deadline:
        time.sleep(0.005)  # a barrier, so the workers really start together
    stop = threading.Event()
    if spec.get("stop_file"):
        def watch():
            while not os.path.exists(spec["stop_file"]):
                time.sleep(0.01)
            stop.set()
        threading.Thread(target=watch, daemon=True).start()
    if spec.get("signals"):
        install_stop_signals(stop)  # as `workbench queue worker` does
    runner = {"recording": recording_runner, "slow": slow_runner,
              "spinning": spinning_runner}[spec["runner"]]
    run_worker(JobQueue(spec["queue"]), runner=runner, poll_s=0.02, stop_event=stop,
               exclusive=spec["exclusive"], heartbeat_s=0.2, grace_s=spec.get("grace_s", 5.0))


def spawn_worker(tmp_path, **spec) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = open(tmp_path / f"child-{time.monotonic_ns()}.log", "wb")
    return subprocess.Popen(
        [sys.executable, "-c", "from tests.engine.runs.test_worker import _child; _child()",
         json.dumps(spec)], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def in_thread(q, runner, **kw):
    """A worker in a background thread: (thread, stop_event, result list)."""
    stop = threading.Event()
    result: list = []
    kw.setdefault("poll_s", 0.01)
    t = threading.Thread(target=lambda: result.append(
        run_worker(q, runner=runner, stop_event=stop, **kw)), daemon=True)
    t.start()
    return t, stop, result


# ---------------------------------------------------------------------------- the runner contract


def test_jobs_run_one_after_another_and_report(q, tmp_path):
    a, b = add_run(q, tmp_path, "a"), add_run(q, tmp_path, "b")
    runner = StepRunner(n_steps=5)
    assert run_worker(q, runner=runner, once=True) == 2
    assert [j.state for j in q.list()] == ["done", "done"]
    run = RunDir(q.get(a).run_dir)
    events = run.metrics()
    assert [e["step"] for e in events] == [1, 2, 3, 4, 5]
    assert all(e["type"] == "step" and "time" in e for e in events)
    st = run.status()
    assert st["state"] == "done" and st["job_id"] == a and st["error"] is None
    assert st["step"] == 5 and st["total_steps"] == 5 and st["loss"] == pytest.approx(0.2)
    assert st["finished_at"] >= st["started_at"]
    assert f"job {a}: started" in run.log_path.read_text()
    assert q.get(b).started_at >= q.get(a).finished_at


@pytest.mark.parametrize("result, state", [(None, "done"), ("done", "done"),
                                           ("paused", "paused"), ("cancelled", "cancelled")])
def test_runner_results(q, tmp_path, result, state):
    job_id = add_run(q, tmp_path, "a")
    run_worker(q, runner=lambda run, control: result, once=True)
    assert q.get(job_id).state == state and RunDir(q.get(job_id).run_dir).status()["state"] == state


def test_cancel_is_honoured_at_the_next_step(q, tmp_path):
    job_id = add_run(q, tmp_path, "a")
    gui = JobQueue(q.path)  # another client of the same queue
    runner = StepRunner(n_steps=50, hooks={5: lambda control: gui.cancel(job_id)})
    run_worker(q, runner=runner, once=True)
    assert runner.steps == [0, 1, 2, 3, 4]  # not one step after the request
    job = q.get(job_id)
    assert job.state == "cancelled" and job.requested_action == "none" and job.finished_at
    assert RunDir(job.run_dir).status()["state"] == "cancelled"


def test_pause_within_one_step_then_resume_continues(q, tmp_path):
    job_id = add_run(q, tmp_path, "a")
    runner = StepRunner(n_steps=40, step_s=0.01)
    t, stop, _ = in_thread(q, runner)
    try:
        assert runner.reached[10].wait(TIMEOUT)
        q.pause(job_id)
        at_request = len(runner.steps)
        wait_for(lambda: q.get(job_id).state == "paused", what="the job to pause")
        assert len(runner.steps) <= at_request + 1  # at most the step in flight
        paused_at = len(runner.steps)
        run = RunDir(q.get(job_id).run_dir)
        assert run.status()["state"] == "paused" and run.status()["step"] == paused_at
        time.sleep(0.1)  # the worker does not touch a paused job
        assert len(runner.steps) == paused_at and q.get(job_id).state == "paused"
        q.resume(job_id)
        wait_for(lambda: q.get(job_id).state == "done", what="the resumed job to finish")
    finally:
        stop.set()
        t.join(TIMEOUT)
    assert runner.steps == list(range(40))  # resumed from its checkpoint: no step twice


def test_cancel_from_another_thread_within_one_step(q, tmp_path):
    job_id = add_run(q, tmp_path, "a")
    runner = StepRunner(n_steps=1000, step_s=0.005)
    t, stop, _ = in_thread(q, runner)
    try:
        assert runner.reached[5].wait(TIMEOUT)
        q.cancel(job_id)
        at_request = len(runner.steps)
        wait_for(lambda: q.get(job_id).state == "cancelled", what="the job to cancel")
        assert len(runner.steps) <= at_request + 1
    finally:
        stop.set()
        t.join(TIMEOUT)


def test_a_failing_job_does_not_stop_the_worker(q, tmp_path):
    def bad_input(run, control):
        raise ConfigError("The learning rate must be positive, got -1.", "Use --lr 1e-4.")

    def buggy(run, control):
        return {}["missing"]

    def out_of_memory(run, control):
        raise MemoryError

    def cancelled(run, control):
        raise Cancelled("stopped")

    runners = {"bad": bad_input, "bug": buggy, "oom": out_of_memory, "weird": lambda r, c: "ok",
               "cancel": cancelled, "good": StepRunner(n_steps=3)}
    ids = {name: add_run(q, tmp_path, name) for name in runners}

    def dispatch(run, control):
        return runners[run.config()["name"]](run, control)

    assert run_worker(q, runner=dispatch, once=True) == len(runners)
    jobs = {name: q.get(i) for name, i in ids.items()}
    assert jobs["good"].state == "done" and jobs["cancel"].state == "cancelled"
    bad = jobs["bad"]
    assert (bad.state, bad.error_kind) == ("failed", "config")
    assert bad.error_message == "The learning rate must be positive, got -1."
    assert bad.error_hint == "Use --lr 1e-4."
    assert "Traceback" in bad.error_detail and "bad_input" in bad.error_detail
    bug = jobs["bug"]
    assert (bug.state, bug.error_kind) == ("failed", "bug")
    assert "KeyError" in bug.error_message and "report" in bug.error_hint
    assert "buggy" in bug.error_detail and "KeyError: 'missing'" in bug.error_detail
    assert jobs["oom"].error_kind == "out_of_memory" and "batch size" in jobs["oom"].error_hint
    assert jobs["weird"].error_kind == "bug" and "'ok'" in jobs["weird"].error_message
    run = RunDir(bad.run_dir)
    assert run.status()["state"] == "failed"
    assert run.status()["error"] == {"kind": "config", "message": bad.error_message,
                                     "hint": "Use --lr 1e-4."}
    assert "Traceback" in run.log_path.read_text()


def test_a_missing_run_directory_fails_the_job_clearly(q, tmp_path):
    job_id = add_run(q, tmp_path, "a")
    RunDir(q.get(job_id).run_dir).config_path.unlink()
    run_worker(q, runner=StepRunner(), once=True)
    job = q.get(job_id)
    assert job.state == "failed" and job.error_kind == "config"
    assert "no config.json" in job.error_message


def test_stopping_the_worker_puts_the_job_back_first_in_line(q, tmp_path):
    a, b = add_run(q, tmp_path, "a"), add_run(q, tmp_path, "b")
    runner = StepRunner(n_steps=1000, step_s=0.005)
    t, stop, result = in_thread(q, runner)
    assert runner.reached[3].wait(TIMEOUT)
    stop.set()
    t.join(TIMEOUT)
    assert result == [1]
    job = q.get(a)
    assert job.state == "queued" and [j.id for j in q.list("queued")] == [a, b]
    assert RunDir(job.run_dir).status()["state"] == "queued"
    assert (RunDir(job.run_dir).checkpoints_dir / "next.json").exists()


def test_heartbeats_continue_during_a_long_step(q, tmp_path):
    job_id = add_run(q, tmp_path, "a")
    beats = []

    def long_step(run, control):
        first = q.get(job_id).heartbeat_at
        wait_for(lambda: q.get(job_id).heartbeat_at > first, timeout=TIMEOUT,
                 what="a heartbeat from the background thread")
        beats.append(q.get(job_id).heartbeat_at - first)
        return "done"

    run_worker(q, runner=long_step, once=True, heartbeat_s=0.05)
    assert q.get(job_id).state == "done" and beats and beats[0] > 0


def test_a_job_taken_over_elsewhere_is_stopped_and_not_recorded(q, tmp_path):
    job_id = add_run(q, tmp_path, "a")

    def steal(control):  # e.g. recovered as stale and claimed by another worker meanwhile
        with sqlite3.connect(q.path) as conn:
            conn.execute("UPDATE jobs SET worker_id = 'other' WHERE id = ?", (job_id,))

    runner = StepRunner(n_steps=20, hooks={3: steal})
    run_worker(q, runner=runner, once=True)
    assert runner.steps == [0, 1, 2] and runner.controls[0].lost
    job = q.get(job_id)
    assert job.state == "running" and job.worker_id == "other"


# ---------------------------------------------------------------------------- runners stuck in Python

GRACE_S = 0.5


def test_cancel_reaches_a_runner_stuck_in_python(q, tmp_path):
    stuck, after = add_run(q, tmp_path, "stuck"), add_run(q, tmp_path, "after")
    runner = StepRunner(n_steps=3)

    def dispatch(run, control):
        return (spinning_runner if run.config()["name"] == "stuck" else runner)(run, control)

    t, stop, _ = in_thread(q, dispatch, heartbeat_s=0.2, grace_s=GRACE_S)
    try:
        wait_for(lambda: (RunDir(q.get(stuck).run_dir).path / "started").exists(),
                 what="the stuck job to start")
        asked = time.monotonic()
        q.cancel(stuck)
        wait_for(lambda: q.get(stuck).state == "cancelled", timeout=10, what="the cancel")
        assert time.monotonic() - asked < GRACE_S + 3
        wait_for(lambda: q.get(after).state == "done", what="the job behind it")
    finally:
        stop.set()
        t.join(TIMEOUT)
    assert RunDir(q.get(stuck).run_dir).status()["state"] == "cancelled"


def test_pause_reaches_a_stuck_runner_and_keeps_its_checkpoint(q, tmp_path):
    job_id = add_run(q, tmp_path, "a")
    run = RunDir(q.get(job_id).run_dir)
    t, stop, _ = in_thread(q, spinning_runner, heartbeat_s=0.2, grace_s=GRACE_S)
    try:
        wait_for(lambda: (run.path / "started").exists(), what="the job to start")
        q.pause(job_id)
        wait_for(lambda: q.get(job_id).state == "paused", timeout=10, what="the pause")
        assert read_json(run.checkpoints_dir / "next.json") == {"step": 7}  # intact
        atomic_write_json(run.checkpoints_dir / "next.json", {"step": 7, "resumed": True})
        q.resume(job_id)
        wait_for(lambda: q.get(job_id).state == "done", what="the resumed job")
    finally:
        stop.set()
        t.join(TIMEOUT)


def test_a_runner_that_swallows_the_interrupt_stops_heartbeating(q, tmp_path):
    job_id = add_run(q, tmp_path, "a")
    release = threading.Event()

    def stubborn(run, control):
        while not release.is_set():
            try:
                spin(0.05)
            except JobInterrupted:
                pass  # e.g. native code that never returns, as far as the worker can tell
        return "cancelled"

    t, stop, _ = in_thread(q, stubborn, heartbeat_s=0.1, grace_s=0.3)
    try:
        wait_for(lambda: q.get(job_id).state == "running", what="the job to start")
        q.cancel(job_id)
        wait_for(lambda: time.time() - q.get(job_id).heartbeat_at > 1.0, timeout=10,
                 what="the heartbeat to go stale")
        assert q.get(job_id).state == "running"  # recover_stale will take it from here
    finally:
        release.set()
        stop.set()
        t.join(TIMEOUT)
    assert q.get(job_id).state == "cancelled"


def test_a_runaway_template_fails_its_job_with_the_budget_message(q, tmp_path, capsys):
    job_id = add_run(q, tmp_path, "a")
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    run_worker(q, runner=lambda run, control: render_chat(loops, [{"role": "user",
                                                                   "content": "hi"}]),
               once=True)
    job = q.get(job_id)
    assert (job.state, job.error_kind) == ("failed", "template")
    assert "exceeded its budget" in job.error_message and "tokenizer.chat_template" in job.error_hint
    assert RunDir(job.run_dir).status()["error"]["kind"] == "template"
    assert run_cli(["queue", "list", "--queue", str(q.path)]) == 0
    assert "template: The chat template '{% for i in range(100000)" in capsys.readouterr().out


def test_sigterm_stops_a_worker_whose_job_is_stuck(q, tmp_path):
    job_id = add_run(q, tmp_path, "a")
    run = RunDir(q.get(job_id).run_dir)
    out = tmp_path / "out"
    out.mkdir()
    proc = spawn_worker(tmp_path, queue=str(q.path), out=str(out), runner="spinning",
                        exclusive=True, signals=True, grace_s=GRACE_S)
    try:
        wait_for(lambda: (run.path / "started").exists(), what="the job to start")
        asked = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert time.monotonic() - asked < GRACE_S + 5
    finally:
        proc.kill()
        proc.wait(TIMEOUT)
    job = q.get(job_id)
    assert job.state == "queued" and [j.id for j in q.list("queued")] == [job_id]
    assert read_json(run.checkpoints_dir / "next.json") == {"step": 7}


# ---------------------------------------------------------------------------- several processes


def test_two_worker_processes_never_run_the_same_job(q, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "runs").mkdir()
    ids = [q.add(RunDir.create(tmp_path / "runs" / f"r{i}", {}).path) for i in range(30)]
    stop_file = tmp_path / "stop"
    spec = dict(queue=str(q.path), out=str(out), runner="recording", exclusive=False,
                n_ready=2, stop_file=str(stop_file))
    procs = [spawn_worker(tmp_path, **spec) for _ in range(2)]
    try:
        # Meanwhile this process adds more jobs, as the GUI would.
        for i in range(30, 40):
            ids.append(q.add(RunDir.create(tmp_path / "runs" / f"r{i}", {}).path))
            time.sleep(0.01)
        wait_for(lambda: all(j.state == "done" for j in q.list()), what="all jobs done")
    finally:
        stop_file.touch()
        for p in procs:
            p.wait(TIMEOUT)
    assert [p.returncode for p in procs] == [0, 0]
    assert not list(out.glob("DUPLICATE-*")), "a job ran twice"
    ran = {f.name: [int(x) for x in f.read_text().split()] for f in out.glob("ran-*.txt")}
    all_runs = [i for v in ran.values() for i in v]
    assert sorted(all_runs) == sorted(ids)
    assert len(ran) == 2, "both workers took jobs"
    workers = {q.get(i).worker_id for i in ids}
    assert len(workers) == 2


@pytest.mark.parametrize("max_attempts, outcome", [(3, "done"), (1, "failed")])
def test_kill_9_mid_job_is_recovered_by_the_next_worker(q, tmp_path, max_attempts, outcome):
    job_id = add_run(q, tmp_path, "a")
    run = RunDir(q.get(job_id).run_dir)
    out = tmp_path / "out"
    out.mkdir()
    proc = spawn_worker(tmp_path, queue=str(q.path), out=str(out), runner="slow",
                        exclusive=True)
    try:
        wait_for(lambda: (run.path / "started").exists(), what="the job to start")
        assert worker_running(q)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(TIMEOUT)
    assert q.get(job_id).state == "running"  # as the dead worker left it
    assert not worker_running(q)  # the OS released its lock
    reached = read_json(run.checkpoints_dir / "next.json")["step"]
    assert reached >= 6

    seen = []

    def resume(run_dir, control):
        seen.append((control.job.attempts, read_json(run_dir.checkpoints_dir / "next.json")))
        return "done"

    run_worker(q, runner=resume, once=True, max_attempts=max_attempts)
    job = q.get(job_id)
    assert job.state == outcome and job.attempts == 1
    if outcome == "done":
        assert seen[0][0] == 1 and seen[0][1]["step"] >= reached  # resumed, not restarted
        assert "resumed after 1 worker death" in run.log_path.read_text()
    else:
        assert seen == [] and job.error_kind == "worker_died"
        assert "gone" in job.error_message and run.status()["state"] == "failed"


# ---------------------------------------------------------------------------- one worker per queue


def test_only_one_worker_per_queue(q, tmp_path):
    assert not worker_running(q)
    t, stop, _ = in_thread(q, StepRunner())
    try:
        wait_for(lambda: worker_running(q), what="the worker lock")
        assert worker_pid(q) == os.getpid()
        with pytest.raises(WorkerAlreadyRunning, match=f"already running .*pid {os.getpid()}"):
            run_worker(q, runner=StepRunner(), once=True)
        assert run_worker(q, runner=StepRunner(), once=True, exclusive=False) == 0
    finally:
        stop.set()
        t.join(TIMEOUT)
    assert not worker_running(q) and worker_pid(q) is None


def test_one_worker_whatever_the_queue_path_is_called(q, tmp_path, monkeypatch):
    link = tmp_path / "link.sqlite3"
    link.symlink_to(q.path)
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    spellings = [link, Path("../q.sqlite3"), tmp_path / "sub" / ".." / "q.sqlite3"]
    t, stop, _ = in_thread(q, StepRunner())
    try:
        wait_for(lambda: worker_running(q), what="the worker lock")
        for path in spellings:   # hard links: refused (test_queue_files.py)
            assert worker_running(path) and worker_pid(path) == os.getpid()
            assert not WorkerLock(path).acquire(timeout_s=0.05)
            with pytest.raises(WorkerAlreadyRunning):
                run_worker(JobQueue(path), runner=StepRunner(), once=True)
    finally:
        stop.set()
        t.join(TIMEOUT)
    assert not any(worker_running(path) for path in spellings)
    assert not worker_running(tmp_path / "no-such-queue.sqlite3")


def test_two_worker_processes_through_a_symlink_take_one_lock(q, tmp_path):
    link = tmp_path / "link.sqlite3"
    link.symlink_to(q.path)
    out = tmp_path / "out"
    out.mkdir()
    stop_file = tmp_path / "stop"
    procs = [spawn_worker(tmp_path, queue=str(path), out=str(out), runner="recording",
                          exclusive=True, n_ready=2, stop_file=str(stop_file))
             for path in (q.path, link)]
    try:
        wait_for(lambda: any(p.poll() is not None for p in procs), what="one worker to give up")
    finally:
        stop_file.touch()
        codes = sorted(p.wait(TIMEOUT) for p in procs)
    assert codes == [0, 1]  # WorkerAlreadyRunning for the second


def test_detached_worker(q, tmp_path, capsys):
    pid = start_worker_detached(q.path)
    try:
        wait_for(lambda: worker_running(q), what="the detached worker")
        assert worker_pid(q) == pid and worker_mod.ensure_worker(q.path) == pid
        assert os.getsid(pid) == pid  # its own session: survives the GUI
        assert (os.getpriority(os.PRIO_PROCESS, pid)       # yields the cores to the desktop
                == min(os.getpriority(os.PRIO_PROCESS, 0) + worker_mod.DETACHED_NICENESS, 19))
        assert run_cli(["queue", "worker", "--once", "--queue", str(q.path)]) == 2
        assert "already running" in capsys.readouterr().err
    finally:
        stopped = worker_mod.stop_worker(q.path)  # SIGTERM: graceful, after the current step
    assert stopped
    wait_for(lambda: not pid_alive(pid), what="the worker to exit")
    worker_mod._reap_children()
    assert not worker_running(q)
    log = worker_mod.worker_log_path(q.path).read_text()
    assert "worker" in log and "stopped after 0 job(s)" in log


def test_queue_worker_command(q, tmp_path, monkeypatch, capsys):
    job_id = add_run(q, tmp_path, "a")
    runner = StepRunner(n_steps=3)
    monkeypatch.setattr(worker_mod, "default_runner", runner)
    before = signal.getsignal(signal.SIGINT)
    assert run_cli(["queue", "worker", "--once", "--queue", str(q.path)]) == 0
    assert signal.getsignal(signal.SIGINT) == before  # handlers restored
    assert q.get(job_id).state == "done" and runner.steps == [0, 1, 2]
    assert "stopped after 1 job(s)" in capsys.readouterr().err


def test_the_worker_module_is_light_and_qt_free():
    code = ("import sys, app.engine.runs.worker, app.engine.runs.queue, app.engine.runs.rundir; "
            "bad = [m for m in sys.modules if m.startswith(('PySide6', 'app.engine.training.session', "
            "'app.views'))]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
