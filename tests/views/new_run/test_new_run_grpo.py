"""New run for GRPO runs: the run type, the prompts-and-rewards tab, inline validation, the
addition demo, and queueing a run directory exactly as `workbench grpo --queue` writes it.
QT_QPA_PLATFORM=offscreen (conftest)."""

from __future__ import annotations

import json

import pytest
from PySide6.QtCore import Qt

from app.cli.main import run_cli
from app.engine.training.grpo import GrpoConfig
from app.engine.runs.rundir import RunDir
from app.views.new_run.grpo_panel import addition_demo
from tests.conftest import SAMPLE_DATA
from tests.views.conftest import SAMPLE_MODEL

ADDITION = SAMPLE_DATA / "addition.jsonl"


@pytest.fixture
def view(qtbot, new_run):
    new_run.set_run_type("grpo")
    qtbot.waitUntil(lambda: new_run.grpo_panel.rows is not None, timeout=10_000)
    return new_run


def test_the_grpo_run_type_shows_prompts_rewards_and_grpo_settings(view):
    assert view.kind() == "grpo" and view.kind_box.currentText() == "GRPO (reward-driven)"
    assert view.tabs.tabText(1) == "2  Prompts and rewards"
    panel = view.grpo_panel
    assert panel.isVisibleTo(view.tabs.widget(1)) and not view.dataset.isVisibleTo(panel)
    assert panel.prompts_path() == str(ADDITION) and panel.rows == 200
    assert panel.preview_table.item(0, 1).text() == "user: What is 93 + 38?"
    assert [r.kind() for r in panel.rewards.rows] == ["exact"]
    form = view.form
    for key in ("epochs", "context", "batch", "grad_accum", "patience", "mode"):
        assert not form[key].isVisibleTo(form), key
    assert form.label("max_steps").text() == "Steps" and form["max_steps"].value() == 100
    assert form.label("val_split").text() == "Held-out prompts"
    assert view.problems() == [] and view.start_button.isEnabled()
    assert "GRPO: addition.jsonl (200 rows) \u00b7 4 prompts \u00d7 8 completions \u00b7 " \
           "exact \u00d71" in view.summary_label.text()
    form["max_steps"].setValue(30)
    view.set_run_type("sft")                        # and back: the dataset and its settings
    assert view.tabs.tabText(1) == "2  Dataset" and form["epochs"].isVisibleTo(form)
    assert form["max_steps"].value() == 0 and view.problems() == []   # epochs, not steps
    view.set_run_type("grpo")
    assert form["max_steps"].value() == 30


def test_queueing_writes_the_run_directory_the_cli_writes(qtbot, view, ctx, tmp_path):
    panel, form = view.grpo_panel, view.form
    panel.rewards.add({"kind": "regex"}).arg_field.setText(r"^\d+$")
    panel.rewards.rows[1].weight_box.setValue(0.5)
    for key, value in (("group_size", 4), ("prompts_per_step", 2), ("temperature", 0.8),
                       ("top_p", 0.9), ("max_new_tokens", 6), ("kl", 0.01)):
        panel.sampling[key].setValue(value)
    panel.sampling["advantage"].setCurrentIndex(panel.sampling["advantage"].findData("no-std"))
    for key, value in (("rank", 4), ("max_steps", 7), ("val_split", 0.05), ("eval_every", 3),
                       ("norms_every", 10)):
        form[key].setValue(value)
    form["lr"].setText("1e-3")
    # the Advanced fields a GRPO run has (issue 29 item 4: the round trip for every run kind)
    form["schedule"].setCurrentIndex(form["schedule"].findData("cosine"))
    form["max_grad_norm"].setValue(0.5)
    form["warmup_fraction"].setValue(0.1)
    form["weight_cache_mb"].setValue(64)
    assert not form["workers"].isVisibleTo(form)     # GRPO trains in one process
    assert view.problems() == []
    view.name_field.setText("grpo-run")
    with qtbot.waitSignal(view.run_created, timeout=10_000):
        qtbot.mouseClick(view.start_button, Qt.LeftButton)
    path = ctx.current_run
    assert path == str(ctx.runs_root() / "grpo-run") and ctx.worker_starts == [1]
    assert [j.run_dir for j in ctx.queue.list("queued")] == [path]
    config = RunDir(path).config()
    assert config["kind"] == "grpo" and GrpoConfig.from_dict(config).to_dict() == config
    assert config["rewards"][1]["kind"] == "regex" and config["rewards"][1]["weight"] == 0.5
    assert (config["group_size"], config["max_new_tokens"], config["advantage"]) == (4, 6,
                                                                                   "no-std")
    assert config["train"]["lora_rank"] == 4 and config["train"]["mode"] == "lora"

    cli_run = tmp_path / "cli-run"                    # the same run from the command line
    assert run_cli(["grpo", "-m", str(SAMPLE_MODEL), "--prompts", str(ADDITION),
                    "--reward", "exact", "--reward", r"regex:^\d+$:0.5", "-G", "4", "-P", "2",
                    "-t", "0.8", "--top-p", "0.9", "-n", "6", "--advantage", "no-std",
                    "--kl", "0.01", "--rank", "4", "--alpha", "16", "--lr", "1e-3",
                    "--targets", "attn,experts,router", "--max-steps", "7",
                    "--val-split", "0.05", "--eval-every", "3", "--schedule", "cosine",
                    "--max-grad-norm", "0.5", "--warmup-fraction", "0.1",
                    "--weight-cache-mb", "64",
                    "-o", str(cli_run), "--queue", str(tmp_path / "cli-queue.sqlite3")]) == 0
    assert RunDir(cli_run).config() == config


def test_problems_are_shown_plainly_and_block_the_start(qtbot, view, tmp_path):
    panel = view.grpo_panel
    row = panel.rewards.rows[0]
    row.kind_box.setCurrentIndex(row.kind_box.findData("regex"))
    row.arg_field.setText("(")
    assert row.error_label.isVisibleTo(panel) and "is invalid" in row.error_label.text()
    assert not view.start_button.isEnabled()
    assert "reward 1 (regex): The regex reward's pattern '(' is invalid" in \
        view.problems_label.text()
    row.kind_box.setCurrentIndex(row.kind_box.findData("numeric"))
    assert row.arg_field.text() == ""               # another kind: its own argument
    row.arg_field.setText("abc")
    assert row.error_label.text() == "Enter a number."
    row.kind_box.setCurrentIndex(row.kind_box.findData("file"))
    assert row.browse_button.isVisibleTo(panel)
    row.arg_field.setText(str(tmp_path / "missing.py"))
    assert "does not exist" in row.error_label.text()
    reward = tmp_path / "short.py"
    reward.write_text("def reward(prompt, completion, **row):\n    return -len(completion)\n")
    row.arg_field.setText(str(reward))
    assert not row.error_label.isVisibleTo(panel)
    assert panel.sampling.needs_answer is False     # no reward compares with the answer
    qtbot.mouseClick(row.remove_button, Qt.LeftButton)
    assert panel.rewards.rows == [] and panel.rewards.empty_label.isVisibleTo(panel)
    assert ("dataset", "Add at least one reward function.") in view.problems()
    panel.rewards.add({"kind": "exact"})
    panel.sampling["temperature"].setValue(0)
    assert "nothing is learned" in panel.sampling.errors()["temperature"]
    panel.sampling["temperature"].setValue(1)
    panel.sampling["answer_field"].setText("")
    assert "answer_field" in panel.sampling.errors()
    panel.sampling["answer_field"].setText("answer")
    view.form["optimizer"].setCurrentIndex(view.form["optimizer"].findData("lbfgs"))
    assert "AdamW or SGD" in view.form.errors()["optimizer"]
    view.form["optimizer"].setCurrentIndex(view.form["optimizer"].findData("adamw"))
    panel.set_prompts_path(str(tmp_path / "nope.jsonl"))
    assert ("dataset", f"There is no file {tmp_path / 'nope.jsonl'}.") in view.problems()
    assert view.create_run() is None and view.tabs.currentIndex() == 1
    panel.set_prompts_path(str(ADDITION))
    assert view.problems() == [] and view.start_button.isEnabled()


def test_the_addition_demo_and_settings_files(qtbot, view, tmp_path):
    view.set_run_type("sft")
    view.grpo_panel.demo_button.click()             # also switches the run type
    demo = addition_demo()
    assert view.kind() == "grpo" and view.form["max_steps"].value() == 40
    assert view.form.lr() == 5e-4 and view.form["val_split"].value() == 0.25
    d = view.config_dict()
    assert {k: d[k] for k in ("group_size", "prompts_per_step", "max_new_tokens",
                              "samples_every", "eval_every", "model", "prompts")} == \
        {k: demo[k] for k in ("group_size", "prompts_per_step", "max_new_tokens",
                              "samples_every", "eval_every", "model", "prompts")}
    cfg = view.build_config()
    assert (cfg.max_steps, cfg.train.lr, cfg.train.lora_rank, cfg.val_split) == (40, 5e-4, 8, 0.25)
    cli_run = tmp_path / "cli-demo"                 # the user guide's command for the demo
    assert run_cli(["grpo", "-m", str(SAMPLE_MODEL), "--prompts", str(ADDITION), "--reward",
                    "exact", "-G", "8", "-P", "8", "-n", "6", "--rank", "8", "--alpha", "16",
                    "--targets", "attn,experts,router", "--lr", "5e-4", "--max-steps", "40",
                    "--val-split", "0.25", "--eval-every", "20", "--samples-every", "5",
                    "-o", str(cli_run), "--queue", str(tmp_path / "q.sqlite3")]) == 0
    assert RunDir(cli_run).config() == cfg.to_dict()
    path = tmp_path / "grpo.json"
    view.save_settings(str(path))
    assert json.loads(path.read_text())["kind"] == "grpo"
    view.set_run_type("sft")
    view.load_settings(str(path))                   # a GRPO settings file: back to GRPO
    assert view.kind() == "grpo" and view.config_dict() == d


def test_a_model_that_fails_right_after_a_switch_leaves_the_dataset_alone(qtbot, view,
                                                                         tmp_path):
    view.form["val_split"].setValue(0.3)            # the dataset's check is out of date
    view.set_run_type("sft")                        # schedules a check of the dataset
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(100))
    view.open_model(str(bad))                       # before it runs: no model to check with
    qtbot.waitUntil(view.model_error_shown, timeout=5000)
    qtbot.wait(400)                                 # longer than the check's debounce
    assert view.dataset.error is None
    assert [tab for tab, _ in view.problems()] == ["model"]


def test_reward_code_from_loaded_settings_runs_only_after_yes(qtbot, view, ctx, tmp_path,
                                                              monkeypatch):
    from PySide6.QtWidgets import QMessageBox

    from app.engine.training.reward_functions import (TRUST_SCOPE, RewardSpec,
                                                      untrusted_reward_files)

    reward = tmp_path / "shared_reward.py"
    reward.write_text("def reward(prompt, completion, **row):\n    return 1.0\n")
    rewards = [RewardSpec("file", arg=str(reward))]
    settings = tmp_path / "shared.json"             # a config from elsewhere naming the file
    settings.write_text(json.dumps(GrpoConfig(model=str(SAMPLE_MODEL), prompts=str(ADDITION),
                                              rewards=tuple(rewards)).to_dict()))
    view.load_settings(str(settings))
    assert [r.kind() for r in view.grpo_panel.rewards.rows] == ["file"]
    assert view.grpo_panel.rewards.code_note.isVisibleTo(view.grpo_panel)
    assert view.problems() == []
    asked = []
    answer = QMessageBox.No
    monkeypatch.setattr(QMessageBox, "question",
                        lambda parent, title, text, *a: asked.append(text) or answer)
    assert view.create_run() is None                # No: nothing starts, nothing is trusted
    assert asked == [f"This run uses reward code from {reward}. It runs as Python with your "
                     f"rights. {TRUST_SCOPE} Run it?"]
    assert ctx.queue.list() == [] and untrusted_reward_files(rewards) == [str(reward)]
    answer = QMessageBox.Yes
    with qtbot.waitSignal(view.run_created, timeout=10_000):
        view.create_run()
    assert len(asked) == 2 and len(ctx.queue.list()) == 1
    assert untrusted_reward_files(rewards) == []    # the worker will run it
    with qtbot.waitSignal(view.run_created, timeout=10_000):
        view.create_run()                           # trusted as it is: not asked again
    assert len(asked) == 2 and len(ctx.queue.list()) == 2
    with reward.open("a") as f:                     # changed since: asked again
        f.write("# edited\n")
    answer = QMessageBox.No
    assert view.create_run() is None and len(asked) == 3 and len(ctx.queue.list()) == 2
