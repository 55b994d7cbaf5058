"""Fixtures for the GUI tests: Qt offscreen, a private context (queue, runs root, settings).

QT_QPA_PLATFORM=offscreen is set before Qt is imported. Every test gets its own job queue,
runs folder and settings file under tmp_path, so nothing touches the user's real state.
"""

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from tests.conftest import GOLDEN, SAMPLE_DATA  # noqa: E402

SAMPLE_MODEL = SAMPLE_DATA / "tiny-moe.gguf"
SAMPLE_CHAT = SAMPLE_DATA / "chat.jsonl"


def wait_ready(qtbot, view):
    """Wait until a New run screen has read its model and checked its dataset."""
    qtbot.waitUntil(lambda: view.card is not None and view.dataset.report is not None
                    and not view.dataset.is_busy() and view.memory_estimate is not None,
                    timeout=15_000)


@pytest.fixture
def settings(tmp_path):
    from PySide6.QtCore import QSettings

    return QSettings(str(tmp_path / "settings.ini"), QSettings.IniFormat)


@pytest.fixture
def ctx(tmp_path, settings, qapp, monkeypatch):
    """An AppContext on a private queue and runs folder (and list of registered runs, kept
    beside the queue); `ensure_worker` is recorded, not run (tests that want the real worker
    process use `real_worker_ctx`)."""
    from app.engine.runs.queue import JobQueue
    from app.views.context import AppContext

    monkeypatch.setenv("WORKBENCH_QUEUE", str(tmp_path / "queue.sqlite3"))
    (tmp_path / "runs").mkdir(exist_ok=True)
    context = AppContext(JobQueue(tmp_path / "queue.sqlite3"), settings,
                         runs_root=tmp_path / "runs")
    context.worker_starts = []
    context.ensure_worker = lambda: context.worker_starts.append(1)
    return context


def untipped_inputs(widget) -> list[str]:
    """The input widgets under `widget` without a tooltip (a spin box's or combo box's own
    line edit is part of it; read-only text is output)."""
    from PySide6.QtWidgets import (QAbstractSpinBox, QCheckBox, QComboBox, QLineEdit,
                                   QPlainTextEdit, QSlider, QWidget)

    inputs = (QLineEdit, QComboBox, QAbstractSpinBox, QCheckBox, QSlider, QPlainTextEdit)
    return [f"{type(w).__name__} {getattr(w, 'text', lambda: '')()}"
            for w in widget.findChildren(QWidget) if isinstance(w, inputs) and not w.toolTip()
            and not isinstance(w.parent(), (QAbstractSpinBox, QComboBox))
            and not (isinstance(w, QPlainTextEdit) and w.isReadOnly())]


def shown(qtbot, view, width: int = 1000, height: int = 700):
    """`view` registered with qtbot (closed after the test), resized and shown."""
    qtbot.addWidget(view)
    view.resize(width, height)
    view.show()
    return view


@pytest.fixture
def new_run(qtbot, ctx):
    """A shown New run screen that has read the sample model and checked chat.jsonl."""
    from app.views.new_run.view import NewRunView

    view = shown(qtbot, NewRunView(ctx, discover=lambda: []), 1100, 720)
    wait_ready(qtbot, view)
    return view


@pytest.fixture
def no_discovery(monkeypatch):
    """The model picker finds nothing on this machine (tests do not scan the home folder)."""
    import app.views.new_run.model_card as model_card

    monkeypatch.setattr(model_card, "discover_models", lambda *a, **k: [])
    import app.views.new_run.view as new_run

    monkeypatch.setattr(new_run, "discover_models", lambda *a, **k: [])


@pytest.fixture
def golden_run_dir(ctx):
    """A finished-looking run folder: the golden Mixtral model and its LoRA as adapter.gguf."""
    import shutil

    from app.engine.runs.rundir import RunDir

    run = RunDir.create(ctx.runs_root() / "golden",
                        {"model": str(GOLDEN / "mixtral-f32.gguf"), "data": "d.jsonl"})
    shutil.copy(GOLDEN / "mixtral-lora.gguf", run.path / "adapter.gguf")
    return str(run.path)


@pytest.fixture
def best_run_dir(ctx):
    """A run folder with checkpoints at steps 10 and 20 and a final adapter, whose best
    evaluation (validation 1.37) was at step 10."""
    import json
    import shutil

    from app.engine.runs.rundir import RunDir

    run = RunDir.create(ctx.runs_root() / "best",
                        {"model": str(GOLDEN / "mixtral-f32.gguf"), "data": "d.jsonl"})
    shutil.copy(GOLDEN / "mixtral-lora.gguf", run.path / "adapter.gguf")
    for step, loss, best in ((10, 1.37, True), (20, 1.83, False)):
        folder = run.checkpoints_dir / f"step-{step}"
        folder.mkdir()                           # what best_checkpoint reads of a checkpoint
        (folder / "meta.json").write_text(json.dumps(
            {"meta": {"run": {"best_step": 10, "best_loss": 1.37}}}))
        run.append_metrics({"type": "eval", "step": step, "loss": loss, "accuracy": 0.5,
                            "perplexity": 4.0, "best": best})
    return str(run.path)


@pytest.fixture
def restore(qapp):
    """The application's theme, style sheet, font and scheme as they were after the test (a
    test that applies the theme, as the app does at its start, leaves no trace for the next)."""
    from app.views.widgets import theme
    from tests.views.test_fits_screen import drop_orphans

    drop_orphans()
    t = theme.current()
    mode, dark = t.mode, t.dark
    sheet, font, palette = qapp.styleSheet(), qapp.font(), qapp.palette()
    yield
    theme.apply_theme(qapp, mode="light", font_scale=1.0)
    t._system_dark = None
    qapp.setStyleSheet(sheet)
    qapp.setFont(font)
    qapp.setPalette(palette)
    t.mode, t.dark = mode, dark
