"""Honest Export (issue 29, item 6): a result is cleared when the inputs that made it change;
the size is shown before writing and after; the checks' figures are explained in words; the
window's errors name its controls, not command-line flags; the llama.cpp cross-check is
disabled with the reason when it cannot run; the screen fits 1280x720. (offscreen: conftest)"""

import os
import re
from types import SimpleNamespace

import pytest
from PySide6.QtWidgets import QAbstractButton, QMessageBox

from app.engine.errors import ConfigError
from app.engine.export import exporter
from app.engine.export.exporter import (DestinationExists, ExportSource, ExportTargetExists,
                                        _load_step, _need_adapter, expected_export_size, export,
                                        source_from_adapter)
from app.engine.export import verify
from app.engine.export.verify import Check, ExportReport, nll_check
from app.engine.model.card import human_bytes
from app.engine.runs.rundir import RunDir
from app.engine.training.checkpoints import DamagedCheckpoint
from app.views.export import view as export_view
from app.views.export.view import ExportView, explain_check, window_words
from tests.views.export.test_export_view import (ADAPTER, MODEL, answer_questions,
                                                 export_and_wait, export_file)
from tests.views.conftest import shown
from tests.views.test_main_window import make_window


@pytest.fixture
def view(qtbot, ctx):
    return shown(qtbot, ExportView(ctx))


def shown_result(view) -> bool:
    return (view.badge.isVisibleTo(view) or view.report is not None
            or view.checks_table.rowCount() > 0 or bool(view.report_text.toPlainText())
            or view.explain_label.isVisibleTo(view) or view.open_folder.isEnabled())


def test_no_to_replace_after_another_export_clears_its_result(qtbot, view, tmp_path,
                                                              monkeypatch):
    """The issue's steps: Ollama exported and VERIFIED, then GGUF LoRA f16 onto an existing
    file, No to Replace: nothing of the Ollama export is left on screen."""
    export_file(view, "ollama", tmp_path / "ollama")
    assert export_and_wait(qtbot, view).ok and shown_result(view)
    existing = tmp_path / "adapter.gguf"
    existing.write_bytes(b"the user's file")
    view.set_format("gguf-lora", "f16")
    view.out_field.setText(str(existing))
    answer_questions(monkeypatch, QMessageBox.No)
    assert isinstance(export_and_wait(qtbot, view), ExportTargetExists)
    assert not shown_result(view) and existing.read_bytes() == b"the user's file"
    assert view.report_title.text() == f"Not exported: {existing} was kept as it was."


def test_no_to_replace_clears_the_result_of_the_same_inputs(qtbot, view, tmp_path, monkeypatch):
    export_file(view, "gguf-lora", tmp_path / "adapter.gguf")
    assert export_and_wait(qtbot, view).ok and shown_result(view)
    asked = answer_questions(monkeypatch, QMessageBox.No)
    assert isinstance(export_and_wait(qtbot, view), ExportTargetExists) and len(asked) == 1
    assert not shown_result(view)


def fake_report(spec):
    report = ExportReport(spec["format"], spec["out"] or "/tmp/x.gguf", source={"model": MODEL})
    report.add(Check("tensors", True, "13 stored arrays as intended"))
    return report


@pytest.mark.parametrize("change", ["format", "type", "checkpoint", "out", "run", "source",
                                    "scale"])
def test_a_result_is_cleared_when_its_inputs_change(qtbot, view, ctx, best_run_dir,
                                                    golden_run_dir, monkeypatch, change):
    monkeypatch.setattr(export_view, "do_export", fake_report)
    ctx.select_run(best_run_dir)
    with qtbot.waitSignal(view.export_finished):
        view.start_export()
        assert not view.form.isEnabled()         # no change while it exports
    assert view.form.isEnabled()                 # and a box that cannot run stays disabled:
    assert view.llamacpp_box.isEnabled() == (export_view.llamacpp_python() is not None)
    assert view.badge.text() == "VERIFIED" and shown_result(view)
    view._fill_checkpoints()                     # listing the same checkpoints again: kept
    assert shown_result(view)
    {"format": lambda: view.set_format("merged"),
     "type": lambda: view.type_box.setCurrentIndex(1),
     "checkpoint": lambda: view.checkpoint_box.setCurrentIndex(2),
     "out": lambda: view.out_field.setText("/tmp/elsewhere.gguf"),
     "run": lambda: ctx.select_run(golden_run_dir),
     "source": lambda: view.source_box.setCurrentIndex(view.source_box.findData("file")),
     "scale": lambda: view.scale.setValue(0.5)}[change]()
    assert not shown_result(view)


def wait_size(qtbot, view) -> str:
    qtbot.waitUntil(lambda: bool(view.size_label.text())
                    and not view.size_label.text().endswith("\u2026"), timeout=20_000)
    return view.size_label.text()


@pytest.mark.parametrize("fmt, adapter_type", [("gguf-lora", "f16"), ("merged", "f16"),
                                               ("peft", "f32"), ("ollama", "q8_0")])
def test_the_size_is_shown_before_writing_and_after(qtbot, view, tmp_path, fmt, adapter_type):
    out = tmp_path / ("out.gguf" if fmt in ("gguf-lora", "merged") else "out")
    export_file(view, fmt, out)
    view.set_format(fmt, adapter_type)
    expected = expected_export_size(source_from_adapter(ADAPTER, MODEL), fmt, adapter_type)
    assert wait_size(qtbot, view) == f"Will write about {human_bytes(expected)}"
    assert not out.exists()
    report = export_and_wait(qtbot, view)
    written = sum(os.path.getsize(f) for f in report.files)
    assert view.size_label.text() == (f"Wrote {human_bytes(written)} (expected about "
                                      f"{human_bytes(expected)})")
    view.out_field.setText(str(tmp_path / "elsewhere"))     # the same size, elsewhere
    assert view.size_label.text() == f"Will write about {human_bytes(expected)}"
    view.set_format("gguf-lora", "f32")          # another target: its own estimate
    assert wait_size(qtbot, view).startswith("Will write about")


def test_a_size_that_cannot_be_known_says_why(qtbot, view, tmp_path):
    export_file(view, "gguf-lora", tmp_path / "out.gguf")
    view.adapter_field.setText(str(tmp_path / "missing.gguf"))
    assert wait_size(qtbot, view).startswith(f"Size unknown: No such file: {tmp_path}")


def test_the_figures_are_explained_in_words(qtbot, view, tmp_path):
    export_file(view, "merged", tmp_path / "merged.gguf")
    report = export_and_wait(qtbot, view)
    kept = next(c for c in report.checks if c.name == "adapter kept").data
    text = view.explain_label.text()
    assert view.explain_label.isVisibleTo(view)
    ppl = [f"{2.718281828 ** kept[k]:,.1f}" for k in ("merged_nll", "live_nll", "base_nll")]
    assert (f"the merged model's perplexity is {ppl[0]} and base + adapter's {ppl[1]}" in text
            and "within the 1% allowed, so the merge keeps the adapter's effect" in text
            and f"The base model alone has perplexity {ppl[2]}" in text)
    assert "the export predicts the same next-token scores" in text
    assert re.search(r"The llama.cpp cross-check (was turned off|did not run: llama-cpp-python "
                     r"is not installed)", text)


def test_a_bad_figure_is_explained_as_bad():
    """The issue's 'adapter kept: perplexity 39786': a passage the model hardly predicts, and a
    merge that lost the adapter's effect, said in words."""
    check = nll_check("adapter kept", 10.9, 10.5, 10.2, "export again with --type f32")
    said = explain_check(check)
    assert "perplexity is 54,176.4 and base + adapter's 36,315.5" in said
    assert "more than the 1% allowed: the merge loses part of the adapter's effect" in said
    assert "less predictable" in said and "hardly predicts this passage" in said
    cross = Check("llamacpp", True, "", {"statistic": "median", "max_abs_diff": 2.5,
                                         "median_position_max_diff": 0.04, "tolerance": 0.1})
    assert explain_check(cross) == ("llama.cpp loads the file and computes the same next-token "
                                    "scores as the engine (typical difference 0.04, allowed 0.1).")


def test_a_failed_verification_says_where_the_file_went(qtbot, view, ctx, golden_run_dir,
                                                        monkeypatch):
    def failed(spec):
        report = fake_report(spec)
        report.add(nll_check("adapter kept", 10.9, 10.5, 10.2, "export again with --type f32"))
        report.moved_from, report.path = "/r/adapter.gguf", "/r/adapter.failed-verification.gguf"
        return report
    monkeypatch.setattr(export_view, "do_export", failed)
    ctx.select_run(golden_run_dir)
    export_and_wait(qtbot, view)
    assert ("It was not written to /r/adapter.gguf (anything there is as it was): it was moved "
            "aside to /r/adapter.failed-verification.gguf." in view.report_text.toPlainText())
    assert "/r/adapter.failed-verification.gguf" in view.report_title.text()
    detail = view.checks_table.item(1, 2).text()       # the check's figures, window words
    assert detail.endswith("export again with Tensor type f32") and "--" not in detail
    assert "the merge loses part of the adapter's effect" in view.explain_label.text()


def engine_hints(tmp_path, run_dir, monkeypatch) -> list[ConfigError]:
    """The errors with command-line flags an export from the window can meet (grep '--' in
    app/engine/export and runs/destinations)."""
    monkeypatch.setattr(exporter, "newest_intact", lambda folder: (SimpleNamespace(step=10), []))
    source = source_from_adapter(ADAPTER, MODEL)
    errors = [DestinationExists(tmp_path / "x.gguf")]
    for call in (lambda: export(source, "merged", MODEL, overwrite=True),
                 lambda: export(source, "peft", tmp_path / "p", adapter_type="q8_0"),
                 lambda: _need_adapter(ExportSource(MODEL), "gguf-lora"),
                 lambda: _load_step(RunDir(run_dir), 7)):
        with pytest.raises(ConfigError) as caught:
            call()
        errors.append(caught.value)
    run = RunDir.create(tmp_path / "run", {"model": MODEL, "data": "d.jsonl"})
    with pytest.raises(ConfigError) as caught:
        export(source, "gguf-lora", run.path / "config.json", overwrite=True)
    return errors + [caught.value]


def test_errors_in_window_words(qtbot, view, tmp_path, best_run_dir, monkeypatch):
    errors = engine_hints(tmp_path, best_run_dir, monkeypatch)
    assert all("--" in e.message + e.hint for e in errors)          # the engine's words
    for error in errors:
        said = window_words(error)
        assert "--" not in said.message + said.hint, said
        assert type(said) is type(error) and "--" in error.message + error.hint  # a copy
    assert window_words(errors[0]).hint == ("Export again and answer Yes when asked to replace "
                                            "it, or choose another Destination.")
    assert window_words(errors[4]).hint.startswith("Export another checkpoint: choose it in the "
                                                   "Checkpoint list (the newest intact one is "
                                                   "step 10; see ")
    damaged = DamagedCheckpoint(tmp_path / "step-3", "meta.json is missing")   # own __init__
    damaged.hint = "Export --checkpoint 2 instead."
    said = window_words(damaged)
    assert type(said) is DamagedCheckpoint and said.reason == "meta.json is missing"
    assert said.hint == "Export checkpoint 2 in the Checkpoint list instead."
    text = tmp_path / "short.txt"                 # the issue's "a smaller --ctx"
    text.write_text("A short text.")
    export_file(view, "gguf-lora", tmp_path / "out.gguf")
    view.text_field.setText(str(text))
    view.start_perplexity()
    qtbot.waitUntil(lambda: view.eval_button.isEnabled(), timeout=20_000)
    assert view.error_panel.title_label.text() == "Perplexity failed"
    assert (view.error_panel.hint_label.text()
            == "Use a longer text or a smaller ctx (beside Perplexity).")


def test_the_llamacpp_check_is_disabled_with_the_reason(qtbot, ctx, monkeypatch, tmp_path):
    monkeypatch.setattr(export_view, "llamacpp_python", lambda: None)
    monkeypatch.setattr(verify, "llamacpp_python", lambda: None)
    view = shown(qtbot, ExportView(ctx))
    box = view.llamacpp_box
    assert not box.isEnabled() and not box.isChecked()
    assert "llama-cpp-python is not installed" in box.toolTip()
    export_file(view, "gguf-lora", tmp_path / "out.gguf")     # the report says why, not "off"
    assert export_and_wait(qtbot, view).ok
    assert ("The llama.cpp cross-check did not run: llama-cpp-python is not installed"
            in view.explain_label.text())
    monkeypatch.setattr(export_view, "llamacpp_python", lambda: "/usr/bin/python3")
    view = shown(qtbot, ExportView(ctx))
    assert view.llamacpp_box.isEnabled() and view.llamacpp_box.isChecked()


def test_the_screen_fits_1280x720(qtbot, ctx, tmp_path):
    """At 1280x720, with a report shown and an error on top: every button, the checks and the
    report can be scrolled fully into view, none squeezed below its minimum."""
    win = make_window(qtbot, ctx)
    win.resize(1280, 720)
    win.show_screen("export")
    view = win.screen("export")
    export_file(view, "merged", tmp_path / "merged.gguf")
    export_and_wait(qtbot, view)
    view.error_panel.present("Cannot export yet", ConfigError("An error on top.", "A hint."))
    qtbot.wait(50)
    assert (win.width(), win.height()) == (1280, 720)
    corner = view.mapTo(win, view.rect().bottomRight())
    assert win.rect().contains(corner)                          # the screen itself is not cut
    viewport = view.scroll.viewport()
    wanted = [w for w in view.scroll.widget().findChildren(QAbstractButton)
              if w.isVisibleTo(view)] + [view.checks_table, view.report_text,
                                         view.explain_label, view.eval_label]
    assert len(wanted) > 8
    for w in wanted:
        assert w.height() >= w.minimumSizeHint().height() and w.width() >= 20, w
        view.scroll.ensureWidgetVisible(w, 0, 0)
        top_left = w.mapTo(viewport, w.rect().topLeft())
        seen = viewport.rect().intersected(w.rect().translated(top_left))
        assert seen.size() == w.size() or w is view.checks_table, (w, seen, w.size())
    assert view.scroll.horizontalScrollBar().maximum() == 0        # nothing cut on the right
    assert not re.search(r"--\w", view.error_panel.hint_label.text())
