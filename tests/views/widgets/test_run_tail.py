"""RunTail: batched live events from a run directory being written."""

from __future__ import annotations

import json
import re
import threading

import numpy as np

from app.views.widgets.run_tail import BackgroundPoll, PacedRedraw, RunTail, Series, clock, ema
from tests.views.fake_runs import FakeRun


class Collector:
    def __init__(self, tail: RunTail):
        self.steps, self.evals, self.norms, self.routing, self.logs = [], [], [], [], []
        self.statuses, self.resets, self.batches = [], [], 0
        tail.steps.connect(self.steps.extend)
        tail.steps.connect(self._batch)
        tail.evals.connect(self.evals.extend)
        tail.norms.connect(self.norms.extend)
        tail.routing.connect(self.routing.extend)
        tail.logs.connect(self.logs.extend)
        tail.status_changed.connect(self.statuses.append)
        tail.reset.connect(self.resets.append)

    def _batch(self, _):
        self.batches += 1


def test_tail_follows_a_run_being_written(qtbot, tmp_path):
    fake = FakeRun(tmp_path / "run", total_steps=300)
    fake.log("tokenizing chat.jsonl")
    tail = RunTail(interval_ms=20)
    got = Collector(tail)
    tail.set_run(fake.path)
    assert got.resets == [fake.path]
    writer = fake.play_in_thread(300, every=10, delay_s=0.001)
    qtbot.waitUntil(lambda: len(got.steps) == 300 and got.statuses
                    and got.statuses[-1].get("step") == 300, timeout=15000)
    writer.join()
    assert [e["step"] for e in got.steps] == list(range(1, 301))      # none lost or repeated
    assert [e["step"] for e in got.norms] == list(range(10, 301, 10))
    assert [e["step"] for e in got.routing] == list(range(10, 301, 10))
    assert len(got.evals) == 30
    assert got.batches < 300                                          # batched, not per event
    assert any("tokenizing chat.jsonl" in line for line in got.logs)
    assert any(line.endswith("start: 300 steps, 2 epoch(s), 1,000 trainable parameters, "
                             "90 train / 10 validation rows") for line in got.logs)
    assert tail.offset == fake.run.metrics_path.stat().st_size
    assert tail.stats["max_tick_ms"] < 50          # the GUI-thread part of a tick is tiny
    tail.stop()


def test_tail_never_returns_a_partial_line(qtbot, tmp_path):
    fake = FakeRun(tmp_path / "run")
    fake.step(3)
    line = json.dumps({"type": "step", "step": 4, "loss": 1.0})
    with open(fake.run.metrics_path, "a") as f:          # half a line, as if being written
        f.write(line[:10])
    tail = RunTail(interval_ms=20)
    got = Collector(tail)
    tail.set_run(fake.path)
    qtbot.waitUntil(lambda: len(got.steps) == 3)
    qtbot.wait(100)
    assert len(got.steps) == 3
    with open(fake.run.metrics_path, "a") as f:
        f.write(line[10:] + "\n")
    qtbot.waitUntil(lambda: len(got.steps) == 4)
    assert got.steps[-1]["step"] == 4
    tail.stop()


def test_switching_runs_resets_and_drops_stale_reads(qtbot, tmp_path):
    a = FakeRun(tmp_path / "a")
    a.step(5)
    b = FakeRun(tmp_path / "b")
    b.step(2)
    tail = RunTail(interval_ms=20)
    got = Collector(tail)
    tail.set_run(a.path)
    tail.set_run(b.path)                      # before the read of `a` was delivered
    qtbot.waitUntil(lambda: len(got.steps) >= 2)
    qtbot.wait(100)
    assert [e["step"] for e in got.steps] == [1, 2]
    assert got.resets == [a.path, b.path]
    assert got.statuses[-1]["step"] == 2
    tail.set_run(None)
    assert not tail.timer.isActive()


def test_a_replaced_metrics_file_is_read_again_from_the_start(qtbot, tmp_path):
    fake = FakeRun(tmp_path / "run")
    fake.step(5)
    tail = RunTail(interval_ms=20)
    got = Collector(tail)
    tail.set_run(fake.path)
    qtbot.waitUntil(lambda: len(got.steps) == 5)
    fake.run.metrics_path.write_text(json.dumps({"type": "step", "step": 1, "loss": 2.0}) + "\n")
    qtbot.waitUntil(lambda: len(got.resets) == 2)
    qtbot.waitUntil(lambda: len(got.steps) == 6)
    assert got.steps[-1] == {"type": "step", "step": 1, "loss": 2.0}
    tail.stop()


def test_log_txt_lines_are_tailed(qtbot, tmp_path):
    fake = FakeRun(tmp_path / "run")
    fake.run.log("job 3: started by worker w1")
    tail = RunTail(interval_ms=20)
    got = Collector(tail)
    tail.set_run(fake.path)
    qtbot.waitUntil(lambda: any("job 3: started" in line for line in got.logs))
    fake.run.log("job 3: failed: dataset: bad row")
    qtbot.waitUntil(lambda: any("job 3: failed" in line for line in got.logs))
    assert sum("job 3: started" in line for line in got.logs) == 1
    line = next(line for line in got.logs if "job 3: started" in line)
    assert re.fullmatch(r"\d\d:\d\d:\d\d job 3: started by worker w1", line)  # no date
    tail.stop()


def test_a_missing_run_directory_is_quiet(qtbot, tmp_path):
    tail = RunTail(interval_ms=20)
    got = Collector(tail)
    tail.set_run(tmp_path / "nothing-here")
    qtbot.wait(100)
    assert got.steps == [] and got.statuses == []
    tail.stop()


def test_the_gui_thread_never_waits_while_a_run_is_written(qtbot, tmp_path, capsys, monkeypatch):
    """All three live screens, each in its own window, follow a run written fast by a
    background thread (600 steps in about a second, with norms and routing events of a
    16-layer, 32-expert model every 10 steps: 3.6 MB); a 10 ms timer on the GUI thread
    records the longest gap between its ticks. The writer only writes lines serialized
    beforehand, as the engine process does (its JSON encoding is not this process's work)."""
    import time

    from PySide6.QtCore import QSettings, QTimer

    from app.engine.runs.queue import JobQueue
    from app.views.context import AppContext
    from app.views.experts.view import ExpertsView
    from app.views.monitor.view import MonitorView
    from app.views.runs.view import RunsView

    (tmp_path / "runs").mkdir()
    monkeypatch.setenv("WORKBENCH_QUEUE", str(tmp_path / "queue.sqlite3"))  # its own run list
    ctx = AppContext(JobQueue(tmp_path / "queue.sqlite3"),
                     QSettings(str(tmp_path / "settings.ini"), QSettings.IniFormat),
                     runs_root=tmp_path / "runs")
    fake = FakeRun(tmp_path / "runs" / "big", total_steps=600, layers=16, experts=32)
    views = [RunsView(ctx), MonitorView(ctx), ExpertsView(ctx)]
    for view in views:
        qtbot.addWidget(view)
        view.resize(1000, 700)
        view.show()
    monitor, experts = views[1], views[2]
    ctx.select_run(fake.path)
    qtbot.wait(300)
    writes = fake.prerender(600, every=10)

    gaps = []
    last = [time.perf_counter()]

    def beat():
        now = time.perf_counter()
        gaps.append(now - last[0])
        last[0] = now

    timer = QTimer(interval=10)
    timer.timeout.connect(beat)
    timer.start()
    t0 = time.perf_counter()
    writer = fake.replay_in_thread(writes, delay_s=0.001)
    qtbot.waitUntil(lambda: not writer.is_alive() and experts.shown_step() == 600
                    and n_points(monitor.loss_curve) == 600, timeout=60000)
    elapsed = time.perf_counter() - t0
    timer.stop()
    size = fake.run.metrics_path.stat().st_size
    longest = max(gaps) * 1000
    stats = monitor.tail.stats
    with capsys.disabled():
        print(f"\n{size / 1e6:.1f} MB of events in {elapsed:.1f} s; longest GUI gap "
              f"{longest:.1f} ms over {len(gaps)} ticks (median {np.median(gaps) * 1000:.1f} "
              f"ms); monitor tail: {stats['reads']} reads, GUI-thread tick max "
              f"{stats['max_tick_ms']:.1f} ms, background read max {stats['max_read_ms']:.1f} ms")
    assert len(gaps) > 50
    assert longest < 100


def n_points(curve) -> int:
    x, _ = curve.getData()
    return 0 if x is None else len(x)


def test_series_and_ema():
    s = Series(2)
    s.extend([(i, float(i)) for i in range(1, 401)])       # grows past its first buffer
    assert s.n == 400 and s.col(1)[-1] == 400
    s.extend([(390, 0.0)])
    assert s.n == 390 and s.col(0)[-1] == 390 and s.col(1)[-1] == 0.0
    y, _, n = ema(np.array([1.0, np.nan, 3.0]), 0.5)
    np.testing.assert_allclose(y, [1.0, 1.0, (0.25 + 1.5) / 0.75])
    assert n == 2


def steps_of(events) -> list[int]:
    return [e["step"] for e in events]


def test_an_attempt_that_repeats_steps_is_deduplicated_for_every_view(qtbot, tmp_path):
    """Attempt 1 reaches step 30 (evals at 10, 20, 30) and is lost; attempt 2 resumes from the
    checkpoint at step 20 and repeats steps 21-25 with other losses. The tail delivers each step
    once, the later attempt's, and nothing of attempt 1 after step 20 (its eval at 30)."""
    fake = FakeRun(tmp_path / "run", total_steps=100)
    for _ in range(3):
        fake.step(10)
        fake.eval()
    tail = RunTail(interval_ms=20)
    got = Collector(tail)
    tail.set_run(fake.path)
    qtbot.waitUntil(lambda: len(got.steps) == 30 and len(got.evals) == 3, timeout=5000)
    assert tail.last_step == 30
    tail.reset.connect(lambda _path: (got.steps.clear(), got.evals.clear()))  # as views do
    for step in range(21, 26):                                    # attempt 2, a later read
        fake.run.append_metrics({"type": "step", "step": step, "loss": 9.0 + step})
    qtbot.waitUntil(lambda: tail.last_step == 25, timeout=5000)
    assert len(got.resets) == 2                                   # set_run's, the restart's
    assert steps_of(got.steps) == list(range(1, 26))              # read again, deduplicated
    assert [e["loss"] for e in got.steps[20:]] == [9.0 + s for s in range(21, 26)]
    assert steps_of(got.evals) == [10, 20]                        # attempt 1's step 30: gone
    fake.run.append_metrics({"type": "step", "step": 26, "loss": 1.0})
    qtbot.waitUntil(lambda: tail.last_step == 26, timeout=5000)
    assert steps_of(got.steps) == list(range(1, 27)) and len(got.resets) == 2

    other = FakeRun(tmp_path / "both", total_steps=100)           # both attempts in one read
    other.step(30)
    for step in range(21, 26):
        other.run.append_metrics({"type": "step", "step": step, "loss": 9.0 + step})
    got.steps.clear()
    tail.set_run(other.path)
    qtbot.waitUntil(lambda: tail.last_step == 25, timeout=5000)
    assert steps_of(got.steps) == list(range(1, 26))
    assert [e["loss"] for e in got.steps[20:]] == [9.0 + s for s in range(21, 26)]


def test_clock():
    assert clock(3725.4) == "1:02:05" and clock(None) == "-" and clock(float("nan")) == "-"


def test_a_tick_during_a_read_reads_again_right_after_it(qtbot):
    """A screen ticks its poll when its state changes; a tick while a read is under way (begun
    before the change) must not wait for the next interval (5 s for Compare's runs)."""
    release, calls = threading.Event(), []

    def read():
        calls.append(len(calls))
        if len(calls) == 1:
            release.wait(5)
        return len(calls)

    poll = BackgroundPoll(read, interval_ms=60_000)
    results = []
    poll.result.connect(results.append)
    poll.start()                                   # the first read, held
    qtbot.waitUntil(lambda: len(calls) == 1, timeout=2000)
    poll.tick()                                    # the state changed: read again
    poll.tick()                                    # (twice: still one more read)
    release.set()
    qtbot.waitUntil(lambda: results == [1, 2], timeout=2000)
    qtbot.wait(200)
    assert calls == [0, 1] and results == [1, 2]
    poll.stop()


def test_paced_redraw_runs_one_callback_per_tick(qtbot):
    calls = []
    paced = PacedRedraw(interval_ms=10)
    for key in "abc":
        paced.add(key, lambda key=key: calls.append(key))
    paced.mark("c", "a")
    paced.mark("a")                                   # already pending: once
    assert calls == [] and paced.timer.isActive()
    qtbot.waitUntil(lambda: calls == ["c", "a"])
    qtbot.waitUntil(lambda: not paced.timer.isActive())
    paced.mark()                                      # everything
    paced.flush()
    assert calls == ["c", "a", "a", "b", "c"]


def test_garbage_is_collected_on_the_gui_thread(qtbot):
    """The reader thread allocates; collections (which destroy Qt objects in garbage cycles)
    must run on the GUI thread only, from a timer."""
    import gc
    import weakref

    from PySide6.QtCore import QObject

    from app.views.widgets import run_tail

    RunTail()                                   # installs it (once per process)
    assert not gc.isenabled()
    assert run_tail._gc_timer is not None and run_tail._gc_timer.isActive()
    threads = []

    class Probe(QObject):
        def __del__(self):
            threads.append(threading.current_thread().name)

    probe = Probe()
    probe.cycle = [probe]                       # cyclic garbage holding a QObject
    ref = weakref.ref(probe)
    del probe
    junk = [[i] for i in range(5000)]           # allocations that would trigger a collection
    qtbot.waitUntil(lambda: ref() is None, timeout=5000)
    del junk
    assert threads == [threading.main_thread().name]


def test_a_run_whose_files_are_a_fifo_or_a_device_never_blocks_the_readers(tmp_path):
    """The tail's read and the best tracker read through the engine's bounded, regular-file-only
    read (a plain open() blocked forever on a FIFO log.txt or metrics.jsonl, and read a
    /dev/zero link until memory ran out). Each read runs in a thread that must end at once."""
    import os

    from app.engine.api import RunDir
    from app.views.widgets.run_best import BestTracker
    from app.views.widgets.run_tail import _read

    fake = FakeRun(tmp_path / "run")
    fake.step(2)
    run = RunDir(fake.path)
    for make in (lambda p: os.mkfifo(p), lambda p: p.symlink_to("/dev/zero")):
        for path in (run.log_path, run.metrics_path):
            path.unlink(missing_ok=True)
            make(path)
        results = []
        readers = [threading.Thread(target=lambda: results.append(_read(run.path, 0, 0)),
                                    daemon=True),
                   threading.Thread(target=lambda: results.append(BestTracker().best(run, "sft")),
                                    daemon=True)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout=10)
        assert not any(reader.is_alive() for reader in readers)
        [tail] = [r for r in results if isinstance(r, dict)]
        assert len(results) == 2 and tail["log"] == []
        for path in (run.log_path, run.metrics_path):
            path.unlink()
            path.write_text("")


def test_a_finished_jobs_log_reads_in_the_order_it_happened(qtbot, tmp_path):
    """Issue 29 item 11: a run the worker ran to its end, opened afterwards (one read), showed
    'done at step 2' before 'job 1: started by worker ...': the events came from metrics.jsonl
    and the job's lines from log.txt, one file after the other. The run's log is one stream."""
    from app.engine.runs.queue import JobQueue
    from app.engine.runs.rundir import RunDir
    from app.engine.runs.worker import run_job_once
    from app.engine.training import events

    def runner(run_dir, control):
        control.report(events.SFT_START(total_steps=2, epochs=1, steps_per_epoch=2,
                                        trainable=10, train_rows=4, val_rows=1, skipped_rows=0,
                                        resumed_at=0))
        control.report(events.LOG_EVENT(message="tokenizing chat.jsonl"))
        control.report({"type": "step", "step": 1, "total_steps": 2, "loss": 1.0})
        control.report({"type": "step", "step": 2, "total_steps": 2, "loss": 0.5})
        control.report(events.SFT_DONE(step=2, reason="finished", best_step=2, best_loss=0.5,
                                       skipped_steps=0, elapsed_s=0.1))
        return "done"

    queue = JobQueue(tmp_path / "q.sqlite3")
    job_id = queue.add(RunDir.create(tmp_path / "run", {"name": "run"}).path)
    assert run_job_once(queue, queue.claim_next("w1"), runner, "w1") == "done"
    tail = RunTail(interval_ms=20)
    got = Collector(tail)
    tail.set_run(tmp_path / "run")
    qtbot.waitUntil(lambda: any(f"job {job_id}: done" in line for line in got.logs))
    tail.stop()
    order = [next(i for i, line in enumerate(got.logs) if text in line) for text in (
        f"job {job_id}: started by worker w1", "start: 2 steps", "tokenizing chat.jsonl",
        "done at step 2", f"job {job_id}: done")]
    assert order == sorted(order), got.logs
    assert sum("done at step 2" in line for line in got.logs) == 1      # each line once
