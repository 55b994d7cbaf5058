"""ExpertsView: norm and router-load heatmaps from a run directory being written."""

from __future__ import annotations

import numpy as np
import pytest

from app.views.experts.view import ExpertsView, expert_matrix, parse_norms, routing_matrix
from tests.views.fake_runs import FakeRun


@pytest.fixture
def experts(ctx, qtbot):
    view = ExpertsView(ctx)
    qtbot.addWidget(view)
    return view


def expected_norms(fake: FakeRun, step: int, kinds=(0, 1, 2)) -> np.ndarray:
    saved, fake.step_no = fake.step_no, step
    out = np.array([[np.sqrt(sum(fake.norm_of(layer, e, k) ** 2 for k in kinds))
                     for e in range(fake.experts)] for layer in range(fake.layers)])
    fake.step_no = saved
    return out


def expected_routing(fake: FakeRun) -> np.ndarray:
    load = np.array([[0.0 if (layer, e) in fake.dead else 1.0 + e
                      for e in range(fake.experts)] for layer in range(fake.layers)])
    return load / load.sum(axis=1, keepdims=True)


def shown_step(view) -> int:
    """The step shown, once both heatmaps are drawn (they are drawn one per event-loop pass)."""
    view.redraw.flush()
    return view.shown_step() or 0


def test_heatmaps_fill_while_the_run_is_written(qtbot, ctx, experts):
    fake = FakeRun(ctx.runs_root() / "moe", layers=4, experts=8, frozen={(1, 3)},
                   dead={(2, 5), (2, 6)})
    ctx.select_run(fake.path)
    assert experts.norm_image.image is None and experts.warnings() == []
    assert "no norms yet" in experts.step_label.text()
    writer = fake.play_in_thread(100, every=10, delay_s=0.002)
    qtbot.waitUntil(lambda: shown_step(experts) == 100, timeout=10000)
    writer.join()
    image = experts.norm_image.image
    assert image.shape == (4, 8)                                      # layers x experts
    np.testing.assert_allclose(image, expected_norms(fake, 100))
    assert experts.columns == [str(e) for e in range(8)]
    np.testing.assert_allclose(experts.routing_image.image, expected_routing(fake))
    assert experts.norm_plot.bar.levels() == pytest.approx((0.0, image.max()))
    assert experts.step_label.text() == "step 100 of 100"
    assert experts.warnings() == [
        "Layer 2: experts 5, 6 received no tokens since the start",
        (f"Layer 1: expert 3 barely changed (update norm under 1% of the largest, "
         f"{image.max():.3g})")]
    assert experts.warning_list.count() == 2

    experts.projection.setCurrentText("down")
    np.testing.assert_allclose(experts.norm_image.image, expected_norms(fake, 100, kinds=(2,)))
    experts.projection.setCurrentText("gate")
    np.testing.assert_allclose(experts.norm_image.image, expected_norms(fake, 100, kinds=(0,)))


def test_the_step_slider_replays_the_growth(qtbot, ctx, experts):
    fake = FakeRun(ctx.runs_root() / "moe")
    ctx.select_run(fake.path)
    fake.play(50, every=10)
    qtbot.waitUntil(lambda: shown_step(experts) == 50)
    assert experts.slider.maximum() == 4
    experts.slider.setValue(0)
    assert shown_step(experts) == 10 and not experts.follow.isChecked()
    np.testing.assert_allclose(experts.norm_image.image, expected_norms(fake, 10))
    assert experts.step_label.text() == "step 10 of 100"          # the run has 100 steps
    fake.play(20, every=10)                                  # new events: the slider stays
    qtbot.waitUntil(lambda: experts.slider.maximum() == 6)
    assert shown_step(experts) == 10
    experts.slider.setValue(6)
    assert experts.follow.isChecked()
    fake.play(10, every=10)
    qtbot.waitUntil(lambda: shown_step(experts) == 80)          # following the latest again
    np.testing.assert_allclose(experts.norm_image.image, expected_norms(fake, 80))


def test_router_window_last_interval_vs_since_start(qtbot, ctx, experts):
    fake = FakeRun(ctx.runs_root() / "moe", layers=2, experts=4)
    ctx.select_run(fake.path)
    fake.play(10, every=10)
    fake.dead = {(0, 1)}                          # expert 1 of layer 0 stops getting tokens
    fake.play(10, every=10)
    qtbot.waitUntil(lambda: shown_step(experts) == 20)
    assert not any("no tokens" in w for w in experts.warnings())   # it had some at first
    experts.window_combo.setCurrentText("last interval")
    np.testing.assert_allclose(experts.routing_image.image, expected_routing(fake))
    assert experts.warnings()[0] == ("Layer 0: expert 1 received no tokens in the interval "
                                     "ending at step 20")


def test_a_dense_model_shows_layers_by_modules(qtbot, ctx, experts):
    fake = FakeRun(ctx.runs_root() / "dense", layers=3, experts=0)
    ctx.select_run(fake.path)
    fake.play(20, every=10)
    qtbot.waitUntil(lambda: shown_step(experts) == 20)
    assert experts.columns == ["q", "k", "v", "out", "gate", "up", "down"]
    assert experts.kinds == ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                             "ffn_up", "ffn_down"]
    expected = np.array([[fake.norm_of(layer, m) for m in range(7)] for layer in range(3)])
    np.testing.assert_allclose(experts.norm_image.image, expected)
    assert experts.routing_image.image is None
    assert experts.routing_plot.isHidden()
    assert experts.moe_controls.isHidden() and not experts.dense_note.isHidden()
    # layer 0's attn_q (1 x 1 x 0.01 x step) is well above 1% of the largest (3 x 7 x ...)
    assert experts.warnings() == []


def test_modules_view_of_a_moe_run(qtbot, ctx, experts):
    fake = FakeRun(ctx.runs_root() / "moe", layers=2, experts=4)
    ctx.select_run(fake.path)
    fake.play(10, every=10)
    qtbot.waitUntil(lambda: shown_step(experts) == 10)
    experts.view_combo.setCurrentText("Modules")
    assert experts.columns == ["q", "E gate", "E up", "E down"]
    image = experts.norm_image.image
    np.testing.assert_allclose(image[:, 0], 0.5)
    np.testing.assert_allclose(image[1, 1], np.sqrt(sum(fake.norm_of(1, e, 0) ** 2
                                                        for e in range(4))))


def test_matrix_helpers():
    parsed = parse_norms({"tensors": {
        "blk.1.ffn_up_exps.weight": {"delta": [3.0, 0.0], "a": [1, 1], "b": [1, 1]},
        "blk.1.ffn_down_exps.weight": {"delta": [4.0, 1.0], "a": [1, 1], "b": [1, 1]},
        "output.weight": {"delta": [1.0], "a": [1], "b": [1]}}})
    m = expert_matrix(parsed)
    assert np.isnan(m[0]).all()                        # layer 0 has no expert adapters
    np.testing.assert_allclose(m[1], [5.0, 1.0])
    r = routing_matrix([{"layers": {"0": [0.5, 0.5]}}, {"layers": {"0": [1.0, 0.0]}}])
    np.testing.assert_allclose(r, [[0.75, 0.25]])
