"""The whole first run through the window, with a REAL engine worker process.

Sample model + sample dataset: press Start now (a 6-step run goes to a private queue, the
window starts the worker), watch Monitor's loss curve and the Experts heatmap fill while the
run is written, see it finish in Runs, export a GGUF adapter and generate with it in the
Playground. Meanwhile a 10 ms timer records the longest time the GUI thread was busy, with a
CPU-bound process beside the window the whole time (a desktop is rarely idle).
(QT_QPA_PLATFORM=offscreen: conftest.)
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PySide6.QtCore import QElapsedTimer, Qt, QTimer

from app.engine.runs.queue import JobQueue
from app.engine.model.lora import load_adapter
from app.engine.runs.rundir import RunDir
from app.views.context import AppContext
from app.views.main_window import MainWindow
from tests.views.conftest import SAMPLE_CHAT, SAMPLE_MODEL

STEPS = 6
MAX_GUI_GAP_MS = 100


class GapMeter:
    """A 10 ms timer; `longest` is the longest interval between two of its ticks (ms)."""

    def __init__(self):
        self.clock, self.last, self.longest = QElapsedTimer(), None, 0
        self.timer = QTimer(interval=10)
        self.timer.timeout.connect(self._tick)

    def start(self):
        self.clock.start()
        self.last = self.clock.elapsed()
        self.timer.start()

    def stop(self):
        self.timer.stop()

    def _tick(self):
        now = self.clock.elapsed()
        self.longest = max(self.longest, now - self.last)
        self.last = now


@pytest.fixture
def real_ctx(tmp_path, settings, qapp, monkeypatch):
    """A context whose ensure_worker starts the real worker process on a private queue; the
    worker is stopped (SIGTERM, then waited for) at the end. The user's state (the list of
    runs) is private too: a first run's window, not one that lists every run the suite made."""
    monkeypatch.setenv("WORKBENCH_QUEUE", str(tmp_path / "queue.sqlite3"))
    ctx = AppContext(JobQueue(tmp_path / "queue.sqlite3"), settings, runs_root=tmp_path / "runs")
    yield ctx
    ctx.stop_worker()


@pytest.fixture
def busy_process():
    """A process that keeps one core busy until the test ends (or, should pytest die, until it
    sees that its parent is gone)."""
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    yield proc
    proc.kill()
    proc.wait()


def curve_points(curve) -> int:
    return 0 if curve.xData is None else len(curve.xData)


@pytest.mark.skipif(not SAMPLE_MODEL.is_file(), reason="the sample model is not bundled")
def test_first_run_from_start_to_playground(qtbot, real_ctx, busy_process):
    ctx = real_ctx
    win = MainWindow(ctx, discover=lambda: [])
    qtbot.addWidget(win)
    win.resize(1200, 780)
    win.show()
    new_run = win.new_run
    qtbot.waitUntil(lambda: new_run.card is not None and new_run.dataset.report is not None
                    and not new_run.dataset.is_busy(), timeout=20_000)
    assert new_run.model_path() == str(SAMPLE_MODEL)
    assert new_run.data_path() == str(SAMPLE_CHAT)

    form = new_run.form
    form["epochs"].setValue(0)
    form["max_steps"].setValue(STEPS)
    form["eval_every"].setValue(3)
    form["save_every"].setValue(3)
    form["norms_every"].setValue(2)
    assert new_run.problems() == []

    gaps = GapMeter()
    gaps.start()
    with qtbot.waitSignal(new_run.run_created, timeout=20_000):
        qtbot.mouseClick(new_run.start_button, Qt.LeftButton)
    run = ctx.current_run
    assert run and RunDir(run).config()["max_steps"] == STEPS
    assert win.current_screen_key() == "monitor"
    qtbot.waitUntil(ctx.worker_running, timeout=20_000)     # the window started the worker

    monitor, experts = win.screen("monitor"), win.screen("experts")
    assert monitor.run_path == run
    qtbot.waitUntil(lambda: curve_points(monitor.loss_curve) >= 1, timeout=60_000)
    partway = curve_points(monitor.loss_curve)
    qtbot.waitUntil(lambda: curve_points(monitor.loss_curve) == STEPS, timeout=60_000)
    x, y = monitor.loss_curve.getData()
    losses = [e["loss"] for e in RunDir(run).metrics() if e.get("type") == "step"]
    np.testing.assert_allclose(y, losses, rtol=1e-6)        # the curve is the run's losses
    assert partway <= STEPS
    qtbot.waitUntil(lambda: experts.norm_image.image is not None, timeout=30_000)
    heat = experts.norm_image.image
    assert heat.shape == (4, 8)                             # layers x experts of the sample
    assert np.all(np.isfinite(heat)) and heat.max() > 0
    assert experts.routing_image.image.shape == (4, 8)
    qtbot.waitUntil(lambda: curve_points(monitor.val_curve) >= 1, timeout=30_000)

    runs = win.screen("runs")
    qtbot.waitUntil(lambda: any(r.path == run and r.state == "done" for r in runs.rows),
                    timeout=60_000)
    gaps.stop()
    print(f"longest GUI-thread gap during the run: {gaps.longest} ms")
    assert (Path(run) / "adapter.gguf").is_file()
    assert gaps.longest < MAX_GUI_GAP_MS, f"the GUI thread was blocked {gaps.longest} ms"

    win.show_screen("export")
    export = win.screen("export")
    assert export.run_dir == run and export.source_box.currentData() == "run"
    export.set_format("gguf-lora", "f32")
    export.llamacpp_box.setChecked(False)
    with qtbot.waitSignal(export.export_finished, timeout=60_000) as done:
        qtbot.mouseClick(export.export_button, Qt.LeftButton)
    report = done.args[0]
    assert not isinstance(report, Exception), report
    assert report.ok and export.badge.text() == "VERIFIED"
    exported = Path(run) / "exports" / "adapter-f32.gguf"
    assert Path(report.path) == exported and load_adapter(exported).tensors

    win.show_screen("playground")
    play = win.screen("playground")
    assert play.model_field.text() == str(SAMPLE_MODEL)
    assert play.checkpoint_box.currentIndex() == 0                  # the best, else the final
    assert play.adapter_key()[1] in (str(Path(run)), str(Path(run) / "adapter.gguf"))
    play.message.setPlainText("What is 2 + 3?")
    play.max_tokens.setValue(16)
    with qtbot.waitSignal(play.finished, timeout=60_000):
        qtbot.mouseClick(play.send_button, Qt.LeftButton)
    assert not play.error_panel.isVisibleTo(play), play.error_panel.message_label.text()
    assert play.base_output.toPlainText().strip()
    assert play.adapter_output.toPlainText().strip()
