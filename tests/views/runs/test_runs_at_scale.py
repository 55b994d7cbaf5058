"""Runs at scale (issue 29, item 8): 10,000 registered runs are listed without stalling the
window's event loop, and a list of runs that cannot be read is said, not shown as 0 runs."""

from __future__ import annotations

import json
import os
import time

from PySide6.QtCore import QTimer

from app.engine.runs.registry import registry_path
from app.views.runs.view import RunsView
from tests.views.conftest import shown

N_RUNS = 10_000


def write_runs(folder, n: int) -> list[str]:
    """`n` minimal finished run folders (config.json, status.json) and their registry lines,
    written directly (RunDir.create would take minutes)."""
    paths, lines = [], []
    config = json.dumps({"model": "/models/tiny.gguf", "data": "/data/chat.jsonl", "epochs": 1})
    for i in range(n):
        path = os.path.join(folder, f"run-{i:05d}")
        os.makedirs(os.path.join(path, "checkpoints"))
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write(config)
        with open(os.path.join(path, "status.json"), "w") as f:
            f.write(json.dumps({"state": "done", "step": 10, "total_steps": 10,
                                "updated_at": 1.7e9 + i}))
        paths.append(path)
        lines.append(json.dumps({"path": path, "created": 1.7e9 + i, "kind": "sft"}))
    registry_path().parent.mkdir(parents=True, exist_ok=True)
    registry_path().write_text("\n".join(lines) + "\n")
    return paths


def test_ten_thousand_runs_keep_the_event_loop_turning(qtbot, ctx, tmp_path):
    paths = write_runs(str(tmp_path / "elsewhere"), N_RUNS)
    gaps, last = [], [time.perf_counter()]

    def beat():
        now = time.perf_counter()
        gaps.append(now - last[0])
        last[0] = now

    t0 = time.perf_counter()
    view = shown(qtbot, RunsView(ctx), 1100, 700)
    built = time.perf_counter() - t0             # the screen itself: it reads no run to build
    timer = QTimer(interval=20)
    timer.timeout.connect(beat)
    last[0] = time.perf_counter()
    timer.start()
    qtbot.waitUntil(lambda: len(view.rows) == N_RUNS, timeout=120_000)
    loaded = time.perf_counter() - t0
    qtbot.wait(2500)                             # two more polls: unchanged runs, not re-read
    timer.stop()
    print(f"\n{N_RUNS} runs listed in {loaded:.1f} s (screen built in {built * 1000:.0f} ms); "
          f"longest gap {max(gaps) * 1000:.0f} ms")
    assert built < 2.0, built                    # the old screen: 1.2 s for 3,000, then stuck
    assert max(gaps) < 0.5, max(gaps)            # about 50 ms measured with nothing beside it
    assert view.model.rowCount() == N_RUNS
    assert {r.path for r in view.rows} == set(paths)
    assert view.text(0, "Status") == "done" and view.text(0, "Steps") == "10/10"
    view.filter_box.setText("run-0999")                  # run-09990 .. run-09999
    assert view.model.rowCount() == 10


def test_an_unreadable_registry_line_is_said(qtbot, ctx, tmp_path):
    write_runs(str(tmp_path / "elsewhere"), 3)
    with open(registry_path(), "a") as f:
        f.write('{"path": "/torn\n')
    view = shown(qtbot, RunsView(ctx))
    view.refresh()
    assert len(view.rows) == 3
    assert not view.problem_label.isHidden()
    assert "1 line(s)" in view.problem_label.text() and "line 4" in view.problem_label.text()


def test_an_unreadable_registry_is_said(qtbot, ctx, tmp_path):
    from tests.views.fake_runs import FakeRun

    here = FakeRun(ctx.runs_root() / "in-the-runs-folder")
    registry_path().unlink()
    registry_path().mkdir()                              # not a file: cannot be read
    view = shown(qtbot, RunsView(ctx))
    qtbot.waitUntil(lambda: not view.problem_label.isHidden())
    assert "could not be read" in view.problem_label.text()
    assert "runs.jsonl" in view.problem_label.text()
    assert [r.path for r in view.rows] == [here.path]    # the runs folder is still listed


def test_only_runs_whose_files_changed_are_read_again(ctx, tmp_path, monkeypatch):
    import app.views.runs.run_rows as run_rows
    from app.engine.runs.rundir import RunDir

    paths = write_runs(str(tmp_path / "elsewhere"), 50)
    reads = []
    read_row = run_rows._read_row
    monkeypatch.setattr(run_rows, "_read_row", lambda path, *a: reads.append(path) or
                        read_row(path, *a))
    lister = run_rows.RunLister()
    first = lister(ctx.queue, ctx.runs_root())
    assert len(reads) == 50
    reads.clear()
    second = lister(ctx.queue, ctx.runs_root())
    assert reads == [] and all(a is b for a, b in zip(first.rows, second.rows))
    RunDir(paths[7]).write_status(state="failed")
    third = lister(ctx.queue, ctx.runs_root())
    assert reads == [paths[7]]
    assert {r.path: r.state for r in third.rows}[paths[7]] == "failed"


def test_a_read_that_fails_is_said_not_swallowed(qtbot, ctx, monkeypatch):
    import app.views.runs.run_rows as run_rows

    def broken():
        raise ValueError("a line the reader did not expect")

    monkeypatch.setattr(run_rows, "read_registry", broken)
    view = shown(qtbot, RunsView(ctx))
    qtbot.waitUntil(lambda: not view.problem_label.isHidden())
    assert view.problem_label.text() == ("The runs could not be read: ValueError: a line the "
                                         "reader did not expect")
