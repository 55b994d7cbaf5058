"""Export: the form follows the selected run and the format; the export runs off the GUI
thread; the verification report is shown and a failed one is flagged. (offscreen: conftest)"""

import hashlib
import shutil
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox

from app.engine.export.exporter import ExportTargetExists
from app.engine.model.lora import load_adapter
from app.engine.runs.rundir import RunDir
from app.engine.export.verify import Check, ExportReport
from app.views.export import view as export_view
from app.views.export.view import ExportView
from app.views.widgets.run_best import FINAL
from tests.views.conftest import GOLDEN, shown

MODEL = str(GOLDEN / "mixtral-f32.gguf")
ADAPTER = str(GOLDEN / "mixtral-lora.gguf")


@pytest.fixture
def view(qtbot, ctx):
    return shown(qtbot, ExportView(ctx))


def export_and_wait(qtbot, view, timeout=60_000):
    with qtbot.waitSignal(view.export_finished, timeout=timeout) as blocker:
        qtbot.mouseClick(view.export_button, Qt.LeftButton)
        assert view.is_busy() and not view.export_button.isEnabled()
    return blocker.args[0]


def test_follows_the_selected_run_and_the_format(view, ctx, golden_run_dir):
    assert view.source_box.currentData() == "file"          # nothing selected yet
    ctx.select_run(golden_run_dir)
    assert view.source_box.currentData() == "run"
    assert view.run_label.text() == golden_run_dir
    items = [view.checkpoint_box.itemData(i) for i in range(view.checkpoint_box.count())]
    assert items == [FINAL]          # no checkpoint kept: no best one
    assert view.out_field.placeholderText() == f"default: {golden_run_dir}/exports/adapter-f32.gguf"
    types = lambda: [view.type_box.itemData(i) for i in range(view.type_box.count())]
    assert types() == ["f32", "f16", "bf16", "q8_0"]
    view.set_format("peft")
    assert types() == ["f32", "f16"]
    view.set_format("merged")            # the type of the tensors the adapter changes
    assert view.type_box.isVisibleTo(view) and types() == ["f16", "f32", "bf16", "q8_0"]
    assert view.out_field.placeholderText().endswith("exports/merged.gguf")


def test_exports_the_final_adapter_and_shows_the_verified_report(qtbot, view, ctx, golden_run_dir):
    ctx.select_run(golden_run_dir)
    view.checkpoint_box.setCurrentIndex(view.checkpoint_box.findData(FINAL))
    view.set_format("gguf-lora", "f16")
    view.llamacpp_box.setChecked(False)
    report = export_and_wait(qtbot, view)
    assert isinstance(report, ExportReport) and report.ok
    out = Path(golden_run_dir) / "exports" / "adapter-f16.gguf"
    assert report.path == str(out) and out.is_file()
    assert load_adapter(out).tensors.keys() == load_adapter(ADAPTER).tensors.keys()
    assert view.badge.text() == "VERIFIED" and view.badge.property("ok") == "true"
    t = view.checks_table
    assert t.rowCount() == len(report.checks) > 0
    assert [t.item(i, 1).text() for i in range(t.rowCount())] == [c.name for c in report.checks]
    assert view.failed_checks() == []
    text = view.report_text.toPlainText()
    assert f"llama-cli -m {MODEL} --lora {out}" in text
    assert (Path(golden_run_dir) / "exports" / "adapter-f16.gguf.verify.json").is_file()
    assert view.open_folder.isEnabled()


def test_an_adapter_file_and_its_model(qtbot, view, tmp_path):
    view.source_box.setCurrentIndex(view.source_box.findData("file"))
    view.adapter_field.setText(ADAPTER)
    view.model_field.setText(MODEL)
    view.set_format("ollama")
    view.llamacpp_box.setChecked(False)
    view.out_field.setText(str(tmp_path / "ollama"))
    report = export_and_wait(qtbot, view)
    assert report.ok and (tmp_path / "ollama" / "Modelfile").is_file()
    assert "ollama create" in view.report_text.toPlainText()


def test_a_failed_verification_is_flagged(qtbot, view, ctx, golden_run_dir, monkeypatch):
    def fake_export(spec):
        report = ExportReport("gguf-lora", "/tmp/x.gguf", source={"model": MODEL})
        report.add(Check("shapes", True, "13 tensors"))
        report.add(Check("engine logits", False, "max |diff| 0.3 > 1e-4"))
        return report

    monkeypatch.setattr(export_view, "do_export", fake_export)
    ctx.select_run(golden_run_dir)
    report = export_and_wait(qtbot, view)
    assert not report.ok
    assert view.badge.text() == "FAILED VERIFICATION" and view.badge.property("ok") == "false"
    assert view.failed_checks() == ["engine logits"]
    assert view.checks_table.item(1, 0).text() == "\u2717 FAILED"
    assert view.checks_table.item(1, 0).foreground().color() == Qt.red
    assert view.report_text.toPlainText().startswith("This export FAILED verification")


def test_errors_go_to_the_panel(qtbot, view, ctx, tmp_path):
    view.source_box.setCurrentIndex(view.source_box.findData("run"))   # no run selected
    qtbot.mouseClick(view.export_button, Qt.LeftButton)
    assert view.error_panel.isVisibleTo(view)
    assert view.error_panel.message_label.text() == "No run is selected."
    empty = RunDir.create(tmp_path / "runs" / "empty", {"model": MODEL, "data": "d.jsonl"})
    ctx.select_run(str(empty.path))                     # a run with nothing saved yet
    result = export_and_wait(qtbot, view)
    assert isinstance(result, Exception)
    assert view.error_panel.title_label.text() == "The export failed"
    assert "no checkpoint yet" in view.error_panel.message_label.text()
    assert view.export_button.isEnabled() and not view.badge.isVisibleTo(view)


def answer_questions(monkeypatch, button) -> list[str]:
    """QMessageBox.question answers `button`; the texts it was asked are recorded."""
    asked = []

    def question(parent, title, text, *args):
        asked.append(text)
        return button
    monkeypatch.setattr(QMessageBox, "question", question)
    return asked


def export_file(view, fmt: str, out: Path, model: str = MODEL) -> None:
    view.source_box.setCurrentIndex(view.source_box.findData("file"))
    view.adapter_field.setText(ADAPTER)
    view.model_field.setText(model)
    view.set_format(fmt)
    view.llamacpp_box.setChecked(False)
    view.out_field.setText(str(out))


def test_replacing_an_existing_output_asks_first(qtbot, view, tmp_path, monkeypatch):
    out = tmp_path / "adapter.gguf"
    out.write_bytes(b"the user's file")
    export_file(view, "gguf-lora", out)
    asked = answer_questions(monkeypatch, QMessageBox.No)
    result = export_and_wait(qtbot, view)
    assert isinstance(result, ExportTargetExists) and result.path == out
    assert asked == [f"Replace {out}?\n\nThe file exists already; the new export takes its place."]
    assert out.read_bytes() == b"the user's file"
    assert not view.error_panel.isVisibleTo(view) and not view.badge.isVisibleTo(view)
    assert view.export_button.isEnabled() and not view.is_busy()
    asked = answer_questions(monkeypatch, QMessageBox.Yes)
    report = export_and_wait(qtbot, view)
    assert len(asked) == 1 and report.ok and report.path == str(out)
    assert load_adapter(out).tensors.keys() == load_adapter(ADAPTER).tensors.keys()
    assert view.badge.text() == "VERIFIED"


def test_an_export_over_its_own_input_is_refused(qtbot, view, tmp_path, monkeypatch):
    base = tmp_path / "base.gguf"
    shutil.copy(MODEL, base)
    before = hashlib.sha256(base.read_bytes()).hexdigest()
    export_file(view, "merged", base, model=str(base))
    asked = answer_questions(monkeypatch, QMessageBox.Yes)
    result = export_and_wait(qtbot, view)
    assert isinstance(result, Exception) and asked == []
    assert view.error_panel.title_label.text() == "The export failed"
    assert (view.error_panel.message_label.text()
            == f"Writing a merged export to {base} would write over the base model ({base}).")
    assert hashlib.sha256(base.read_bytes()).hexdigest() == before


def test_the_best_checkpoint_is_the_default_and_says_its_step(view, ctx, best_run_dir,
                                                              golden_run_dir):
    ctx.select_run(best_run_dir)
    box = view.checkpoint_box
    assert box.currentText() == "Best checkpoint, step 10 (validation 1.37)"
    assert [box.itemData(i) for i in range(box.count())] == ["best", FINAL, "20"]   # each once
    assert export_view.choice_step(best_run_dir, view.spec()["checkpoint"]) == 10
    box.setCurrentIndex(2)                               # any kept checkpoint
    ctx.select_run(golden_run_dir)
    ctx.select_run(best_run_dir)                         # another run: its best again
    assert box.currentData() == "best"
    form = [w for row in view._rows.values() for w in row]          # every row of the form
    assert [w for w in form if not w.toolTip()] == []
