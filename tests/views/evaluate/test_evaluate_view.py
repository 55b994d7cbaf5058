"""The Evaluate screen: base and a run's adapter on the sample suite and tasks, queued and run
by the worker's own loop (as the GRPO end-to-end test runs its job), the results shown as a
table and a bar chart with error bars, saved with the run. QT_QPA_PLATFORM=offscreen."""

from __future__ import annotations

import os
import shutil

import pyqtgraph as pg
from PySide6.QtCore import Qt

from app.engine.evaluation.store import read_evals
from app.engine.runs.worker import run_worker
from app.views.evaluate.view import EvaluateView
from tests.conftest import GOLDEN, SAMPLE_DATA
from tests.views.conftest import untipped_inputs


def _run_with_adapter(root, name: str):
    run = root / name
    run.mkdir()
    (run / "config.json").write_text('{"model": "m.gguf"}')
    shutil.copy(GOLDEN / "gemma3-lora.gguf", run / "adapter.gguf")
    return run


def test_evaluate_queues_follows_and_shows_the_results(qtbot, ctx):
    run = _run_with_adapter(ctx.runs_root(), "lora-run")
    view = EvaluateView(ctx)
    qtbot.addWidget(view)
    view.resize(1280, 800)
    assert [view.tasks.item(i).text() for i in range(view.tasks.count())] == [
        f"suite:{SAMPLE_DATA / 'eval_suite.jsonl'}", str(SAMPLE_DATA / "eval_tasks.jsonl")]
    assert untipped_inputs(view) == []
    view.model.setText(str(GOLDEN / "gemma3-f32.gguf"))
    view.tasks.clear()
    view.add_task(f"mc:{SAMPLE_DATA.parent}/tests/data/eval/mc.bin")
    view.add_task(f"winogrande:{SAMPLE_DATA.parent}/tests/data/eval/winogrande.csv")
    view.add_task("nonsense")
    assert "Not a task" in view.message.text() and view.tasks.count() == 2
    view.limit.setValue(6)
    view.tick("lora-run")
    qtbot.mouseClick(view.evaluate_button, Qt.LeftButton)
    assert ctx.worker_starts == [1] and not view.evaluate_button.isEnabled()
    assert view.job_folder.parent == run / "evals"           # queued, not run in the window

    assert run_worker(ctx.queue, once=True, poll_s=0.01) == 1  # the engine's worker loop
    with qtbot.waitSignal(view.finished, timeout=10_000):
        view.poll()
    assert view.progress.value() == view.progress.maximum() == 4
    assert view.table.rowCount() == 2 and view.table.columnCount() == 2
    assert [view.table.verticalHeaderItem(i).text() for i in range(2)] == ["base", "lora-run"]
    saved = read_evals(run)
    assert len(saved) == 4 and {r["n"] for r in saved} == {6}
    first = saved[0]
    assert view.table.item(0, 0).text().startswith(f"{100 * first['value']:.1f}")
    bars = [i for i in view.chart.getPlotItem().items if isinstance(i, pg.BarGraphItem)]
    errors = [i for i in view.chart.getPlotItem().items if isinstance(i, pg.ErrorBarItem)]
    assert len(bars) == 2 and len(errors) == 2 and len(view.bars) == 4
    assert view.evaluate_button.isEnabled() and not view.cancel_button.isEnabled()
    if os.environ.get("WORKBENCH_SHOTS"):
        view.grab().save(os.path.join(os.environ["WORKBENCH_SHOTS"], "evaluate.png"))


def test_a_cancelled_evaluation_saves_nothing(qtbot, ctx):
    run = _run_with_adapter(ctx.runs_root(), "r")
    view = EvaluateView(ctx)
    qtbot.addWidget(view)
    view.model.setText(str(GOLDEN / "gemma3-f32.gguf"))
    qtbot.mouseClick(view.evaluate_button, Qt.LeftButton)
    qtbot.mouseClick(view.cancel_button, Qt.LeftButton)
    run_worker(ctx.queue, once=True, poll_s=0.01)
    view.poll()
    assert "cancel" in view.message.text().lower() and not (run / "evals.jsonl").exists()
    assert view.evaluate_button.isEnabled()


def test_runs_details_pane_shows_the_latest_evaluation(tmp_path):
    """Runs' details pane reads RUN/evals.jsonl as the Evaluate screen writes it."""
    from app.engine.evaluation.results import TaskResult
    from app.engine.evaluation.store import save_evals
    from app.engine.runs.rundir import RunDir
    from app.views.runs.details import evals_of

    run = tmp_path / "run"
    run.mkdir()
    old = {"base": [TaskResult("mc:a.bin", "mc", "acc", 0.5, 0.1, 10)]}
    save_evals(run, old, {"base": None}, {})
    new = {"base": [TaskResult("mc:a.bin", "mc", "acc", 0.25, 0.05, 10)],
           "lora": [TaskResult("suite:s.jsonl", "suite", "pass_rate", 0.4, 0.1, 10,
                               {"passed": 4})]}
    save_evals(run, new, {"base": None, "lora": "a.gguf"}, {})
    assert evals_of(RunDir(run)) == ("2 evaluation(s) in evals.jsonl; the latest: base mc:a.bin "
                                     "25.00 +- 5.00, lora suite:s.jsonl 40.0% (4/10)")
