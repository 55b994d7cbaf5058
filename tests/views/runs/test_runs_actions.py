"""Runs (issue 29, item 7): compact cells, names whole when they fit, a details pane, delete
(to the trash, asking first), rename (a display name), sort, filter, one Continue, and the
screen at 1280x720."""

from __future__ import annotations

import json

import pytest
from PySide6.QtCore import QPoint, Qt

from app.engine.api import human_bytes, read_registry
from app.views.runs.details import config_summary
from app.views.runs.table import COL
from app.views.runs.view import RunsView
from tests.views.conftest import shown
from tests.views.fake_runs import FakeRun, fake_config

DEFAULT_NAME = "20261128-064712-chat"           # a default run name (date, time, dataset)


def make(ctx, name, steps=10, **kw) -> FakeRun:
    fake = FakeRun(ctx.runs_root() / name, total_steps=100, **kw)
    fake.step(steps)
    return fake


def listed(qtbot, ctx, width=1000, height=700) -> RunsView:
    view = shown(qtbot, RunsView(ctx), width, height)
    view.refresh()
    return view


def names(view) -> list[str]:
    return [view.text(i, "Run") for i in range(view.model.rowCount())]


def test_the_main_window_at_1280x720_shows_every_column_whole(qtbot, ctx, qapp, restore):
    """The state, the best evaluation and a default name are not clipped at 1280x720, in the
    font the app's style sheet sets (10 pt: the columns were sized in Qt's default 9 pt before
    the sheet applied, and Run was left 165 px for a 166 px name)."""
    from app.views.main_window import MainWindow
    from app.views.widgets import theme

    theme.apply_theme(qapp, mode="light")                  # as prepare_app does at the start
    fake = make(ctx, DEFAULT_NAME, 30)
    fake.eval()
    fake.run.write_status(state="running")
    win = MainWindow(ctx, discover=lambda: [])
    qtbot.addWidget(win)
    win.resize(1280, 720)
    win.show()
    win.show_screen("runs")
    view = win.screen("runs")
    view.refresh()
    qtbot.waitUntil(lambda: view.model.rowCount() == 1)
    assert win.width() <= 1280 and win.height() <= 720
    table = view.table
    viewport = table.viewport().rect()
    metrics = table.fontMetrics()
    for column in ("Run", "Best", "Status", "Steps", "Created"):
        c = COL[column]
        x, width = table.columnViewportPosition(c), table.columnWidth(c)
        assert x >= 0 and x + width <= viewport.width(), (column, x, width, viewport)
        text = view.text(0, column)
        assert metrics.horizontalAdvance(text) + 12 <= width, (column, text, width)
    assert view.text(0, "Run") == DEFAULT_NAME
    # the eliding columns give up only what Run needs (at the table's width once laid out)
    from app.views.runs.table import PADDING, RUN_SAMPLE, SAMPLES
    natural = metrics.horizontalAdvance(SAMPLES["Model"]) + PADDING
    if table.columnWidth(COL["Model"]) < natural:
        needed = metrics.horizontalAdvance(RUN_SAMPLE) + PADDING
        assert table.columnWidth(COL["Run"]) <= needed + 3, (table.columnWidth(COL["Run"]), needed)
    assert view.model.index(0, COL["Run"]).data(Qt.ToolTipRole) == fake.path
    assert view.buttons["delete"].geometry().right() <= view.width()


def test_the_details_pane_shows_paths_best_checkpoint_settings_exports_and_evals(
        qtbot, ctx, best_run_dir):
    from pathlib import Path

    run = Path(best_run_dir)
    (run / "exports" / "model.Q8_0.gguf").write_bytes(b"x" * 2048)
    (run / "evals.jsonl").write_text(json.dumps({      # a line as save_evals writes it
        "eval_id": "e1", "model": "base", "task": "suite:chat.jsonl", "kind": "suite",
        "metric": "pass_rate", "value": 0.25, "stderr": None, "n": 8, "passed": 2}) + "\n")
    view = listed(qtbot, ctx)
    view.select(best_run_dir)
    text = view.details.text()
    assert best_run_dir in text
    assert f"step 10: {run / 'checkpoints' / 'step-10'}" in text
    assert "mixtral-f32.gguf" in text and "d.jsonl" in text
    assert config_summary(fake_config()).startswith("2 epoch(s), learning rate 0.005, LoRA rank 8")
    assert f"model.Q8_0.gguf ({human_bytes(2048)})" in text
    assert "1 evaluation(s) in evals.jsonl; the latest: base suite:chat.jsonl 25.0% (2/8)" in text
    view.buttons["details"].click()                      # collapsible
    assert view.details.isHidden()


def test_delete_asks_moves_to_the_trash_and_drops_the_run(qtbot, ctx, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))   # the trash of this test
    (tmp_path / "data").mkdir()
    keep, gone = make(ctx, "keep"), make(ctx, "gone")
    for fake in (keep, gone):
        fake.finish()
    ctx.queue.add(gone.path)                             # its finished job stays in the queue
    ctx.queue.finish(ctx.queue.claim_next("w").id, "w", "done")
    view = listed(qtbot, ctx)
    asked = []
    view.confirm = lambda title, text: asked.append(text) or False
    view.select(gone.path)
    view.delete()                                        # answered No: nothing happens
    assert len(asked) == 1 and gone.path in asked[0]
    assert gone.run.path.is_dir()
    view.confirm = lambda title, text: True
    view.delete()
    assert not gone.run.path.exists()
    assert (tmp_path / "data" / "Trash" / "files" / "gone").is_dir()
    assert gone.path in read_registry().forgotten
    assert [r.name for r in view.rows] == ["keep"]


def test_delete_refuses_a_running_run_and_a_system_without_trash(qtbot, ctx):
    busy, idle = make(ctx, "busy"), make(ctx, "idle")
    ctx.queue.add(busy.path)
    idle.finish()
    view = listed(qtbot, ctx)
    view.confirm = lambda title, text: pytest.fail("a queued run is not offered for deletion")
    view.select(busy.path)
    assert not view.buttons["delete"].isEnabled()
    view.delete()                                        # forced: refused, explained
    assert "cannot be deleted" in view.error_panel.message_label.text()
    assert busy.run.path.is_dir()
    view.confirm = lambda title, text: True
    view.trash = lambda path: False                      # no trash here
    view.select(idle.path)
    view.delete()
    assert idle.run.path.is_dir() and "trash" in view.error_panel.message_label.text()
    assert idle.path not in read_registry().forgotten


def test_rename_gives_a_display_name_and_keeps_the_folder(qtbot, ctx):
    fake = make(ctx, DEFAULT_NAME)
    view = listed(qtbot, ctx)
    view.select(fake.path)
    view.ask_name = lambda row: "lr sweep, 0.005"
    view.rename()
    assert names(view) == ["lr sweep, 0.005"]
    assert fake.run.path.is_dir() and fake.run.path.name == DEFAULT_NAME
    assert view.model.index(0, COL["Run"]).data(Qt.ToolTipRole) == \
        f"lr sweep, 0.005\nFolder: {fake.path}"
    assert ctx.current_run == fake.path                  # still selected, same run
    view.rename("")                                      # back to the folder's name
    assert names(view) == [DEFAULT_NAME]


def test_headers_sort_and_the_filter_matches_name_model_dataset_and_state(qtbot, ctx):
    for name, steps in (("b-run", 30), ("a-run", 10), ("c-run", 20)):
        make(ctx, name, steps)
    make(ctx, "d-done", 5).finish()
    view = listed(qtbot, ctx)
    queue_order = names(view)
    header = view.table.horizontalHeader()
    x = header.sectionViewportPosition(COL["Run"]) + 5
    qtbot.mouseClick(header.viewport(), Qt.LeftButton, pos=QPoint(x, 5))
    assert names(view) == ["a-run", "b-run", "c-run", "d-done"]
    qtbot.mouseClick(header.viewport(), Qt.LeftButton, pos=QPoint(x, 5))
    assert names(view) == ["d-done", "c-run", "b-run", "a-run"]
    qtbot.mouseClick(header.viewport(), Qt.LeftButton, pos=QPoint(x, 5))
    assert names(view) == queue_order and header.sortIndicatorSection() == -1
    view.table.sortByColumn(COL["Steps"], Qt.DescendingOrder)
    assert names(view) == ["b-run", "c-run", "a-run", "d-done"]
    view.filter_box.setText("done")
    assert names(view) == ["d-done"]
    view.filter_box.setText("tiny-moe running")           # every word: model and state
    assert names(view) == ["b-run", "c-run", "a-run"]
    assert "3 shown" in view.summary.text()
    view.filter_box.setText("chat.jsonl c-")
    assert names(view) == ["c-run"]


def test_one_continue_button_with_its_reason(qtbot, ctx):
    view = listed(qtbot, ctx)
    texts = [b.text() for b in view.buttons.values()]
    assert "Resume from checkpoint" not in texts and "Retry" not in texts
    assert "last checkpoint" in view.buttons["continue"].toolTip()
