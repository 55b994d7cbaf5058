"""Experts screen (issue 29, item 11): the step label names the run's total steps, and every
control says what it does."""

from __future__ import annotations

from PySide6.QtWidgets import QAbstractButton

from app.views.experts.view import ExpertsView
from tests.views.conftest import untipped_inputs
from tests.views.fake_runs import FakeRun


def test_step_label_names_the_runs_total_not_the_last_record(qtbot, ctx):
    """A 48-step run with norms every 5 steps: the last record is step 45 of 48."""
    view = ExpertsView(ctx)
    qtbot.addWidget(view)
    fake = FakeRun(ctx.runs_root() / "moe48", total_steps=48)
    ctx.select_run(fake.path)
    fake.play(48, every=5)
    fake.finish()
    qtbot.waitUntil(lambda: view.step_label.text() == "step 45 of 48")
    assert view.slider.maximum() == 8                     # records at 5, 10, ..., 45
    view.slider.setValue(0)
    assert view.step_label.text() == "step 5 of 48"


def test_every_control_has_a_tooltip(qtbot, ctx):
    view = ExpertsView(ctx)
    qtbot.addWidget(view)
    assert untipped_inputs(view) == []
    assert [b.text() for b in view.findChildren(QAbstractButton) if not b.toolTip()] == []
