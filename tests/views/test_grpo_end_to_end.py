"""A GRPO run through the window: queued from New run on a golden model, run by the worker's
own loop (`run_worker`, as tests/engine run SFT and GRPO jobs), then shown in Monitor (reward
curves, completions) and Runs. QT_QPA_PLATFORM=offscreen (conftest)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PySide6.QtCore import Qt

from app.engine.runs.rundir import RunDir
from app.engine.runs.worker import run_worker
from app.views.monitor.view import MonitorView
from app.views.new_run.view import NewRunView
from app.views.runs.view import RunsView
from tests.views.conftest import GOLDEN


def test_a_tiny_grpo_run_from_new_run_to_monitor(qtbot, ctx, tmp_path):
    prompts = tmp_path / "plus-one.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i} plus one is", "answer": str(i + 1)})
                               + "\n" for i in range(6)))
    view = NewRunView(ctx, discover=lambda: [])
    qtbot.addWidget(view)
    view.open_model(str(GOLDEN / "mixtral-f32.gguf"))
    qtbot.waitUntil(lambda: view.card is not None, timeout=10_000)
    view.set_run_type("grpo")
    panel, form = view.grpo_panel, view.form
    panel.set_prompts_path(str(prompts))
    panel.rewards.add({"kind": "length", "weight": 0.5, "target": 2})
    for key, value in (("group_size", 2), ("prompts_per_step", 2), ("max_new_tokens", 4),
                       ("samples_every", 1)):
        panel.sampling[key].setValue(value)
    for key, value in (("rank", 2), ("max_steps", 2), ("val_split", 0.34), ("eval_every", 1),
                       ("norms_every", 1)):
        form[key].setValue(value)
    form["lr"].setText("1e-2")
    qtbot.waitUntil(lambda: panel.rows == 6, timeout=10_000)
    assert view.problems() == []
    with qtbot.waitSignal(view.run_created, timeout=10_000):
        qtbot.mouseClick(view.queue_button, Qt.LeftButton)
    path = ctx.current_run
    assert RunDir(path).config()["kind"] == "grpo"

    assert run_worker(ctx.queue, once=True, poll_s=0.01) == 1       # the worker's loop
    [job] = ctx.queue.list()
    assert job.state == "done", job.error
    run = RunDir(path)
    assert (run.path / "adapter.gguf").is_file()
    events = run.metrics()
    steps = [e for e in events if e["type"] == "step"]
    samples = [e for e in events if e["type"] == "samples"]
    assert [e["step"] for e in steps] == [1, 2] and len(samples) == 2
    assert run.status()["reward_mean"] == steps[-1]["reward_mean"]     # for `runs list`, Runs

    monitor = MonitorView(ctx)
    qtbot.addWidget(monitor)
    monitor.set_smoothing(0)
    ctx.select_run(path)
    g = monitor.grpo
    assert monitor.kind.name == "grpo"
    qtbot.waitUntil(lambda: g.reward_curve.xData is not None and len(g.reward_curve.xData) == 2)
    monitor.redraw.flush()
    np.testing.assert_allclose(g.reward_curve.getData()[1], [e["reward_mean"] for e in steps])
    assert set(g.function_curves) == {"exact", "length"}
    assert list(g.eval_reward_curve.getData()[0]) == [0, 1, 2]
    assert "held-out" in monitor.stats_label.text()
    table = monitor.completions
    qtbot.waitUntil(lambda: table.step_box.count() == 5)          # 2 samples + 3 evaluations
    table.select(2, "sampled")
    items = samples[-1]["items"]
    assert [r[1] for r in table.rows()] == [it["prompt"] for it in items]
    assert [r[4] for r in table.rows()] == [f"{it['reward']:.2f}" for it in items]

    runs = RunsView(ctx)
    qtbot.addWidget(runs)
    runs.refresh()
    assert runs.text(0, "Type") == "GRPO"
    evals = [e for e in RunDir(path).metrics() if e.get("type") == "eval"]
    best = max(e["reward_mean"] for e in evals)         # Best: the held-out reward's best
    text = runs.text(0, "Best")
    assert text.startswith(f"{best:.3f} @ ")
    assert int(text.rsplit(" ", 1)[1]) in [e["step"] for e in evals if e["reward_mean"] == best]


@pytest.mark.slow
def test_the_addition_demo_from_new_run_raises_the_reward(qtbot, new_run, ctx):
    """Issue 9's acceptance run through the window: New run's demo button on the sample model,
    150 steps (about 35 s here), run by the worker's loop. Seeded; the reward over the last 20
    steps must clearly beat the first 20 (0.14 -> 0.38 on the development machine)."""
    new_run.set_run_type("grpo")
    new_run.grpo_panel.demo_button.click()
    new_run.form["max_steps"].setValue(150)
    qtbot.waitUntil(lambda: new_run.problems() == [], timeout=10_000)
    with qtbot.waitSignal(new_run.run_created, timeout=10_000):
        qtbot.mouseClick(new_run.queue_button, Qt.LeftButton)
    assert run_worker(ctx.queue, once=True, poll_s=0.01) == 1
    [job] = ctx.queue.list()
    assert job.state == "done", job.error
    rewards = [e["reward_mean"] for e in RunDir(ctx.current_run).metrics() if e["type"] == "step"]
    assert len(rewards) == 150
    first, last = np.mean(rewards[:20]), np.mean(rewards[-20:])
    assert last > first + 0.15, (first, last)
