"""Issue 32 in the Monitor: a run trained with --eval-task gets its task's accuracy as a curve
beside the loss (titled with the task, 0-1 like a preference run's accuracy, whole-step ticks);
Compare lists each shown run's latest evaluation from its evals.jsonl (as the engine saves it),
and a run without one says so."""

from __future__ import annotations

import os

import pytest

from app.engine.evaluation.results import TaskResult
from app.engine.evaluation.store import save_evals
from app.views.monitor.view import MonitorView
from tests.views.conftest import shown
from tests.views.fake_runs import FakeRun
from tests.views.test_fits_screen import font_scale  # noqa: F401  (a fixture: 1x, 1.5x fonts)

TASK = "mc:tasks.jsonl"
WAIT_MS = 15_000      # the reads take milliseconds; a busy machine may delay the reader thread


def n_points(curve) -> int:
    return 0 if curve.xData is None else len(curve.xData)


@pytest.fixture
def monitor(ctx, qtbot):
    return shown(qtbot, MonitorView(ctx), 1200, 760)


def task_run(path, accuracies: list[float]) -> FakeRun:
    """A run whose evaluations (every 5 steps) carry --eval-task's accuracy."""
    run = FakeRun(path, total_steps=5 * len(accuracies))
    for acc in accuracies:
        run.step(5)
        run.eval(task=TASK, task_acc=acc)
    return run


def test_the_task_accuracy_is_a_curve_beside_the_loss(qtbot, ctx, monitor):
    plain = FakeRun(ctx.runs_root() / "plain", total_steps=10)
    plain.step(10)
    plain.eval()
    ctx.select_run(plain.path)
    qtbot.waitUntil(lambda: n_points(monitor.val_curve) == 1, timeout=WAIT_MS)
    monitor.redraw.flush()
    assert monitor.task_plot.isHidden() and n_points(monitor.task_curve) == 0

    run = task_run(ctx.runs_root() / "with-task", [0.25, 0.5, 0.75])
    ctx.select_run(run.path)
    qtbot.waitUntil(lambda: n_points(monitor.task_curve) == 3, timeout=WAIT_MS)
    monitor.redraw.flush()
    assert not monitor.task_plot.isHidden() and monitor.task_plot.isVisible()
    x, y = monitor.task_curve.getData()
    assert list(x) == [5, 10, 15] and list(y) == [0.25, 0.5, 0.75]   # the events' values
    item = monitor.task_plot.getPlotItem()
    assert TASK in item.titleLabel.text and "accuracy" in item.titleLabel.text.lower()
    assert item.getAxis("left").labelText == "accuracy (share)"
    assert item.getAxis("bottom").labelText == "step"
    lo, hi = monitor.task_plot.getViewBox().viewRange()[0]
    assert (lo, hi) == (0.0, 15.0)                               # the whole run
    axis = item.getAxis("bottom")
    ticks = [v for _, vs in axis.tickValues(lo, hi, axis.width()) for v in vs]
    assert ticks and all(v == int(v) for v in ticks)
    bottom, top = monitor.task_plot.getViewBox().viewRange()[1]
    assert bottom <= 0.0 and top >= 1.0                          # 0-1, fixed
    # the best step (by validation loss or, with --best-by task, by this) says both
    best = f"step 15 (validation {FakeRun.loss_at(15) + 0.1:.2f}, task accuracy 0.75)"
    assert monitor.best_mark.text == f"best: {best}"
    assert f"best at {best}" in monitor.stats_label.text()
    os.makedirs("/tmp/shots", exist_ok=True)
    monitor.grab().save("/tmp/shots/monitor-task-accuracy.png")

    ctx.select_run(plain.path)                                   # gone with the run
    qtbot.waitUntil(lambda: n_points(monitor.val_curve) == 1, timeout=WAIT_MS)
    assert monitor.task_plot.isHidden()


def saved(run: FakeRun, results: dict[str, list[TaskResult]]) -> None:
    save_evals(run.path, results, {label: None if label == "base" else "/a/sft.gguf"
                                   for label in results}, {TASK: "mc:/data/tasks.jsonl"})


def test_compare_lists_the_runs_latest_evaluations(qtbot, ctx, monitor):
    a = FakeRun(ctx.runs_root() / "run-a")
    a.step(5)
    b = FakeRun(ctx.runs_root() / "run-b")
    b.step(5)
    c = FakeRun(ctx.runs_root() / "run-c")
    c.step(5)
    saved(a, {"base": [TaskResult(TASK, "jsonl", "acc", 0.1, 0.05, 20)]})    # older: not shown
    saved(a, {"base": [TaskResult(TASK, "jsonl", "acc", 0.4, 0.1125, 20)],
              "sft": [TaskResult(TASK, "jsonl", "acc", 0.45, 0.1141, 20)]})
    saved(b, {"sft": [TaskResult("suite:eval_suite.jsonl", "suite", "pass_rate", 0.05, None,
                                 20, {"passed": 1, "mean_reward": 1.05})]})
    compare = monitor.compare
    ctx.select_run(a.path)
    qtbot.waitUntil(lambda: "run-a" in compare.evaluations, timeout=WAIT_MS)
    assert compare.evaluations == {"run-a": [("base", TASK, "40.00 +- 11.25"),
                                             ("sft", TASK, "45.00 +- 11.41")]}
    assert compare.evals_table.isVisible()
    qtbot.waitUntil(lambda: compare.compare_list.count() == 3, timeout=WAIT_MS)
    compare.runs_poll.timer.stop()      # no 5-s poll from here: ticking a run reads its own
    compare.set_compared(b.path)
    compare.set_compared(c.path)        # while b's read is under way
    qtbot.waitUntil(lambda: len(compare.evaluations) == 3, timeout=WAIT_MS)
    assert compare.evaluations["run-b"] == [("sft", "suite:eval_suite.jsonl", "5.0% (1/20)")]
    assert compare.evaluations["run-c"] == [("\u2014", "\u2014", "none saved")]
    table = compare.evals_table
    cells = [[table.item(r, c).text() for c in range(3) if table.item(r, c)]
             for r in range(table.rowCount())]
    assert cells == [["run-a"], ["base", TASK, "40.00 +- 11.25"], ["sft", TASK, "45.00 +- 11.41"],
                     ["run-b"], ["sft", "suite:eval_suite.jsonl", "5.0% (1/20)"],
                     ["run-c"], ["\u2014", "\u2014", "none saved"]]
    assert table.columnSpan(0, 0) == 3                           # the run's name over its rows
    qtbot.waitUntil(lambda: n_points(monitor.loss_curve) == 5, timeout=WAIT_MS)
    monitor.redraw.flush()
    os.makedirs("/tmp/shots", exist_ok=True)
    monitor.grab().save("/tmp/shots/monitor-compare-evals.png")

    compare.set_compared(b.path, False)                          # no longer shown
    assert "run-b" not in compare.evaluations


def test_a_damaged_evals_file_says_so(qtbot, ctx, monitor):
    a = FakeRun(ctx.runs_root() / "run-a")
    a.step(5)
    (a.run.path / "evals.jsonl").write_text('{"eval_id": "x"}\nnot json\n')
    ctx.select_run(a.path)
    qtbot.waitUntil(lambda: "run-a" in monitor.compare.evaluations, timeout=WAIT_MS)
    assert "line 2: not a JSON object" in monitor.compare.evaluations["run-a"][0][2]
    b = FakeRun(ctx.runs_root() / "run-b")
    (b.run.path / "evals.jsonl").mkdir()                  # not a file: said, runs still listed
    monitor.compare.set_compared(b.path)
    qtbot.waitUntil(lambda: "run-b" in monitor.compare.evaluations, timeout=WAIT_MS)
    assert "evals.jsonl" in monitor.compare.evaluations["run-b"][0][2]
    assert monitor.compare.compare_list.count() == 2


@pytest.mark.slow
def test_the_task_plot_and_evaluations_fit_1280x720(qtbot, ctx, font_scale):  # noqa: F811
    """Monitor at 1280x720 (1x and 1.5x fonts: test_fits_screen's checks) following a run with
    a task curve, compared with two runs that have evaluations: nothing cut, no scrolling."""
    from app.views.main_window import MainWindow
    from tests.views.conftest import wait_ready
    from tests.views.test_fits_screen import HEIGHT, WIDTH, page_problems, screen_pages

    a = task_run(ctx.runs_root() / "2026-11-28-0647-a-run-with-a-task", [0.2, 0.35, 0.4])
    others = [task_run(ctx.runs_root() / name, [0.3]) for name in ("second", "third")]
    for run in others:
        saved(run, {"base": [TaskResult(TASK, "jsonl", "acc", 0.4, 0.1125, 20)],
                    "sft": [TaskResult(TASK, "jsonl", "acc", 0.45, 0.1141, 20)]})
    win = MainWindow(ctx, discover=lambda: [])
    qtbot.addWidget(win)
    win.resize(WIDTH, HEIGHT)
    win.show()
    wait_ready(qtbot, win.new_run)
    monitor = win.screen("monitor")
    ctx.select_run(a.path)
    qtbot.waitUntil(lambda: monitor.compare.compare_list.count() == 3, timeout=WAIT_MS)
    for run in others:
        monitor.compare.set_compared(run.path)
    qtbot.waitUntil(lambda: len(monitor.compare.evaluations) == 3, timeout=WAIT_MS)
    qtbot.waitUntil(lambda: n_points(monitor.task_curve) == 3, timeout=WAIT_MS)
    problems, seen = {}, []
    for page in screen_pages(win, "monitor"):
        if found := page_problems(win):
            problems[page] = found
        if page == "monitor":                           # the loss page, as it opens
            seen = [monitor.task_plot.isVisible(), monitor.compare.evals_table.isVisible()]
            monitor.redraw.flush()
            os.makedirs("/tmp/shots", exist_ok=True)
            win.grab().save(f"/tmp/shots/monitor-evals-1280x720-{font_scale}x.png")
    assert not problems, problems
    assert seen == [True, True]


def test_an_unreadable_evals_file_is_said_not_raised(monkeypatch):
    """An OSError (permissions, a disk gone) would have failed the whole runs poll."""
    from app.views.monitor import run_compare

    def denied(path):
        raise PermissionError(13, "Permission denied", f"{path}/evals.jsonl")

    monkeypatch.setattr(run_compare, "latest_evals", denied)
    assert run_compare.eval_rows("/r") == [("\u2014", "\u2014",
                                            "/r/evals.jsonl: Permission denied")]
