"""New run's preference methods (issue 31, the window's part): DPO, ORPO, SimPO and KTO as run
types with their fields, one settings object per kind from the engine's defaults (nothing leaks
between kinds, Reset gives the defaults back), config.json as `workbench train --method` writes
it, a DPO run's settings file loaded into the DPO kind, the Dataset tab showing a pair, and a DPO
run started from New run, run by the worker's loop and followed in Monitor.
QT_QPA_PLATFORM=offscreen (conftest)."""

from __future__ import annotations

import json

import pytest
from PySide6.QtCore import Qt

from app.cli.main import run_cli
from app.engine.api import PreferenceConfig, RunDir
from app.views.new_run.settings_form import FIRST_VAL_SPLIT
from tests.conftest import SAMPLE_DATA
from tests.views.conftest import SAMPLE_MODEL
from tests.views.new_run.test_settings_truth import start

PREFERENCES = SAMPLE_DATA / "preferences.jsonl"
# each method's own fields as the window sets them, and the CLI's flags for the same values
METHOD_CHOICES = {
    "dpo": ({"beta": 0.2, "pref_loss": "ipo", "label_smoothing": 0.0, "sft_weight": 0.5},
            ["--beta", "0.2", "--pref-loss", "ipo", "--sft-weight", "0.5"]),
    "orpo": ({"orpo_lambda": 0.25}, ["--orpo-lambda", "0.25"]),
    "simpo": ({"beta": 2.5, "simpo_gamma": 0.75, "label_smoothing": 0.1},
              ["--beta", "2.5", "--simpo-gamma", "0.75", "--label-smoothing", "0.1"]),
    "kto": ({"kto_desirable_weight": 1.5, "kto_undesirable_weight": 0.5},
            ["--kto-desirable-weight", "1.5", "--kto-undesirable-weight", "0.5"]),
}


def set_field(form, key, value):
    w = form[key]
    if hasattr(w, "findData"):
        w.setCurrentIndex(w.findData(value))
    else:
        w.setValue(value)


def choose(qtbot, view, kind: str, data=PREFERENCES):
    """Run type `kind` on the sample preferences, the pair lint done."""
    view.kind_box.setCurrentIndex(view.kind_box.findData(kind))
    view.dataset.set_data_path(str(data))
    qtbot.waitUntil(lambda: view.dataset.pair_report is not None
                    and not view.dataset.is_busy(), timeout=15_000)


@pytest.mark.parametrize("method", list(METHOD_CHOICES))
def test_the_window_and_the_cli_write_the_same_preference_run(qtbot, new_run, tmp_path,
                                                              method):
    """The round trip of each preference kind: the same choices in the window (its method's
    fields, pairs per step, epochs) and on `workbench train --method` give the same
    config.json (before: no such run type)."""
    view, form = new_run, new_run.form
    choose(qtbot, view, method)
    fields, flags = METHOD_CHOICES[method]
    for key, value in fields.items():
        set_field(form, key, value)
    form["pairs_per_step"].setValue(4)
    form["epochs"].setValue(2)
    view.name_field.setText(f"window-{method}")
    config = start(qtbot, view, view.queue_button)
    assert config["kind"] == method

    cli_run = tmp_path / f"cli-{method}"
    assert run_cli(["train", "--method", method, "-m", str(SAMPLE_MODEL), "-d",
                    str(PREFERENCES), "--rank", "8", "--alpha", "16", "--targets",
                    "attn,experts,router", "--val-split", str(FIRST_VAL_SPLIT), "--batch", "4",
                    "--epochs", "2", *flags, "-o", str(cli_run),
                    "--queue", str(tmp_path / "cli-queue.sqlite3")]) == 0
    assert RunDir(cli_run).config() == config


def test_switching_dpo_supervised_dpo_leaks_nothing_and_reset_works(qtbot, new_run):
    """DPO's settings stay DPO's: a supervised run shows its own defaults and writes no
    preference key, and going back shows DPO's as they were left; Reset gives DPO the
    engine's defaults back (`train --method dpo`'s)."""
    view, form = new_run, new_run.form
    sft_before, sft_data = form.values(), view.data_path()
    view.set_run_type("dpo")
    assert view.data_path() == str(PREFERENCES)              # its own file: the sample's
    for method in METHOD_CHOICES:               # each choice's help names its command line
        tip = view.kind_box.itemData(view.kind_box.findData(method), Qt.ToolTipRole)
        assert f"workbench train --method {method}" in tip
    for key, flag in (("beta", "--beta"), ("pref_loss", "--pref-loss"),
                      ("pairs_per_step", "--batch"), ("adapter", "--init-adapter")):
        assert flag in form[key].toolTip(), key
    assert form["pref_loss"].isVisibleTo(form) and not form["orpo_lambda"].isVisibleTo(form)
    assert not form["packing"].isVisibleTo(form) and not form["batch"].isVisibleTo(form)
    form["beta"].setValue(0.3)
    set_field(form, "pref_loss", "hinge")
    form["rank"].setValue(16)
    form["lr"].setText("0.001")
    view.set_run_type("sft")
    assert form.values() == sft_before                       # nothing of DPO's
    assert view.data_path() == sft_data                      # nor its file
    assert "--adapter" in form["adapter"].toolTip()
    assert not form["beta"].isVisibleTo(form)
    form["rank"].setValue(4)                                  # nor of SFT's into DPO
    view.set_run_type("dpo")
    d = form.values()
    assert (d["kind"], d["beta"], d["pref_loss"], d["train"]["lora_rank"],
            d["train"]["lr"]) == ("dpo", 0.3, "hinge", 16, 0.001)
    qtbot.mouseClick(view.reset_button, Qt.LeftButton)
    d = form.values()
    engine = PreferenceConfig(model="", data="", method="dpo").to_dict()
    for key in ("beta", "pref_loss", "label_smoothing", "sft_weight", "pairs_per_step",
                "epochs", "eval_every", "save_every"):
        assert d[key] == engine[key], key
    assert d["train"]["lora_rank"] == 8 and d["val_split"] == FIRST_VAL_SPLIT
    view.set_run_type("kto")        # KTO trains a pair as two rows: twice the steps
    qtbot.waitUntil(lambda: view.dataset.pair_report is not None
                    and not view.dataset.is_busy(), timeout=15_000)
    pairs = view.dataset.pair_report["pairs"]
    assert form.train_windows == round(2 * pairs * (1 - FIRST_VAL_SPLIT))
    view.set_run_type("simpo")                                # SimPO: its own beta default
    assert form["beta"].specialValueText() == "default (2)"
    assert form.values()["beta"] is None


def test_a_dpo_settings_file_loads_into_the_dpo_kind(qtbot, new_run, tmp_path):
    """A DPO run's config.json switches New run to DPO with its settings (before: refused,
    commit 0bc912f, with the command line to run it)."""
    view = new_run
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"kind": "dpo", "model": str(SAMPLE_MODEL),
                                "data": str(PREFERENCES), "beta": 0.2, "pref_loss": "hinge",
                                "pairs_per_step": 6, "micro_batch_tokens": 1024}))
    view.load_settings(str(path))
    assert view.kind() == "dpo"
    d = view.config_dict()
    assert (d["beta"], d["pref_loss"], d["pairs_per_step"]) == (0.2, "hinge", 6)
    assert d["micro_batch_tokens"] == 1024                    # kept though it has no field
    assert d["data"] == str(PREFERENCES)
    path.write_text(json.dumps({"kind": "dpo", "train": {"lora_dropout": 0.1}}))
    view.load_settings(str(path))        # refused at Start: said, under a field in sight
    assert "no LoRA dropout" in view.form.errors()["dropout"]
    assert view.form["dropout"].isVisibleTo(view.form)


def test_the_dataset_tab_shows_a_preference_file_as_pairs(qtbot, new_run):
    """The Dataset tab of a DPO run: the pairs counted, identical/empty/too-long counted, one
    pair with its chosen and rejected completions each highlighted (before: linted as a
    supervised dataset)."""
    view = new_run
    choose(qtbot, view, "dpo")
    r = view.dataset.pair_report
    assert r["pairs"] > 0 and r["format"] == "preference"
    summary = view.dataset.summary_label.text()
    assert f"{r['pairs']:,} pairs accepted" in summary and "identical pairs" in summary
    text = view.dataset.example_view.toPlainText()
    assert "CHOSEN" in text and "REJECTED" in text
    assert text.index("CHOSEN") < text.index("REJECTED")
    spans = view.dataset.highlighted_spans()
    assert len(spans) >= 2                       # one completion in each half at least
    assert any(b <= text.index("REJECTED") for a, b in spans)
    assert any(a > text.index("REJECTED") for a, b in spans)
    assert "chosen and rejected" in view.dataset.example_title.text()
    from app.views.widgets import theme      # the dark theme: the pair again, its title kept
    from PySide6.QtWidgets import QApplication
    mode = theme.current().mode
    theme.apply_theme(QApplication.instance(), mode="dark")
    try:
        assert "chosen and rejected" in view.dataset.example_title.text()
        assert len(view.dataset.highlighted_spans()) == len(spans)
    finally:
        theme.apply_theme(QApplication.instance(), mode=mode)
    assert "pairs" in view.tabs.tabText(1).lower()
    assert not view.problems()
    # the estimate's activations: a micro-batch of packed completions (2,048 tokens, at most
    # the model's context), as the CLI's check_run_memory counts them (before: "context 256")
    tokens = min(PreferenceConfig.micro_batch_tokens, view.card.config.context_length)
    qtbot.waitUntil(lambda: f"({tokens:,} tokens" in view.memory_label.text(), timeout=10_000)


def test_a_supervised_file_is_refused_for_a_dpo_run(qtbot, new_run):
    view = new_run
    view.set_run_type("dpo")
    view.dataset.set_data_path(str(SAMPLE_DATA / "chat.jsonl"))
    qtbot.waitUntil(lambda: view.dataset.error is not None, timeout=15_000)
    assert "not a preference dataset" in view.dataset.error.message
    assert any("cannot be used" in m for _, m in view.problems())


@pytest.mark.slow
def test_a_dpo_run_from_new_run_to_monitor(qtbot, new_run, ctx):
    """Start on New run with DPO on the sample preferences (a few steps), the worker's loop
    runs it, Monitor follows it: the held-out accuracy at each evaluation."""
    from tests.views.test_dpo_end_to_end import run_and_follow

    view, form = new_run, new_run.form
    choose(qtbot, view, "dpo")
    form["rank"].setValue(4)
    form["epochs"].setValue(0)
    form["max_steps"].setValue(6)
    form["eval_every"].setValue(3)
    config = start(qtbot, view)
    assert config["kind"] == "dpo" and config["max_steps"] == 6
    run, evals, monitor = run_and_follow(qtbot, ctx)     # the worker's loop, then Monitor
    assert [e["step"] for e in evals] == [0, 3, 6]
    assert "held-out accuracy" in monitor.best_mark.text


def test_a_kto_file_of_unpaired_rows_shows_its_labels(qtbot, new_run, tmp_path):
    """KTO's {"prompt", "completion", "label"} rows: counted by label, one row shown with its
    completion highlighted and named by its label; an empty completion is flagged by line."""
    rows = [{"prompt": "What do bees make?", "completion": "Bees make honey.", "label": True},
            {"prompt": "Can birds fly?", "completion": "No.", "label": False},
            {"prompt": "What is 2 + 2?", "completion": "", "label": True}]
    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    view = new_run
    choose(qtbot, view, "kto", path)
    r = view.dataset.pair_report
    assert (r["format"], r["desirable"], r["undesirable"], r["empty"]) == ("kto", 1, 1, 1)
    assert "1 desirable and 1 undesirable rows accepted" in view.dataset.summary_label.text()
    assert view.dataset.bad_rows()[0][0] == "3"
    text = view.dataset.example_view.toPlainText()
    assert "DESIRABLE" in text and "REJECTED" not in text
    assert len(view.dataset.highlighted_spans()) == 1
    assert "its completion highlighted" in view.dataset.example_title.text()
    assert not view.problems()
    view.set_run_type("dpo")        # DPO needs pairs: said before Start (the run would fail)
    qtbot.waitUntil(lambda: view.dataset.pair_report is not None
                    and not view.dataset.is_busy(), timeout=15_000)
    assert any("unpaired (KTO) rows: DPO needs chosen/rejected pairs" in m
               for _, m in view.problems())


def test_a_mostly_rejected_preference_file_asks_first(qtbot, new_run, ctx, tmp_path,
                                                     monkeypatch):
    """3 of 4 rows of a DPO file unusable (identical, empty, not JSON): Start asks, naming the
    lines and why, as for a supervised dataset; No queues nothing, Yes queues (before: it
    started without a word)."""
    from PySide6.QtWidgets import QMessageBox

    from tests.views.new_run.test_settings_truth import answer_questions

    rows = [json.dumps({"prompt": "What do bees make?", "chosen": "Honey. Have a nice day!",
                        "rejected": "Honey."}),
            json.dumps({"prompt": "Can birds fly?", "chosen": "Yes.", "rejected": "Yes."}),
            json.dumps({"prompt": "Hi", "chosen": "", "rejected": "Hello."}), "not json"]
    path = tmp_path / "mostly-bad-pairs.jsonl"
    path.write_text("\n".join(rows) + "\n")
    view = new_run
    choose(qtbot, view, "dpo", path)
    assert view.dataset.pair_report["pairs"] == 1
    asked = answer_questions(monkeypatch, QMessageBox.No)
    assert view.create_run() is None and ctx.queue.list("queued") == []
    assert len(asked) == 1 and "3 of the 4 rows" in asked[0]
    assert "line 2: chosen and rejected are identical" in asked[0]
    assert "line 4: invalid JSON" in asked[0]
    asked = answer_questions(monkeypatch, QMessageBox.Yes)
    start(qtbot, view)
    assert len(asked) == 1 and len(ctx.queue.list("queued")) == 1


def test_every_setting_of_a_preference_run_has_a_field(new_run):
    """Every PreferenceConfig setting has a field on New run's DPO (and KTO) but the derived
    train.max_steps, the batch accumulation (pairs per step is the batch) and the micro-batch
    (kept from a loaded file; the estimate uses its default)."""
    from tests.views.new_run.test_settings_truth import flat_keys

    view = new_run
    for method in ("dpo", "kto"):
        view.set_run_type(method)
        engine = PreferenceConfig(model="", data="", method=method).to_dict()
        assert flat_keys(engine) - flat_keys(view.config_dict()) == {
            "train.max_steps", "train.grad_accum", "micro_batch_tokens"}
        assert set(view.config_dict()) <= set(engine) | {"kind"}    # and nothing else


def test_a_saved_kto_settings_file_loads_back_the_same(qtbot, new_run, tmp_path):
    """Save settings of a KTO run, reset, switch to Supervised, load the file: KTO again with
    the same settings (what the window writes, it reads back)."""
    view, form = new_run, new_run.form
    choose(qtbot, view, "kto")
    form["kto_desirable_weight"].setValue(1.25)
    form["beta"].setValue(0.05)
    form["max_steps"].setValue(30)
    saved = view.config_dict()
    path = tmp_path / "kto-settings.json"
    view.save_settings(str(path))
    qtbot.mouseClick(view.reset_button, Qt.LeftButton)
    view.set_run_type("sft")
    view.load_settings(str(path))
    assert view.kind() == "kto" and view.config_dict() == saved
