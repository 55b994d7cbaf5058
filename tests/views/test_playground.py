"""Playground: base and adapter side by side, streaming in a thread, stoppable; the adapter of
the selected run or a file. QT_QPA_PLATFORM=offscreen (conftest)."""

import shutil
import threading

import pytest
from PySide6.QtCore import Qt

from app.engine import load_adapter, load_model
from app.engine.text.chat_template import chat_prompt_ids
from app.views.playground import FROM_FILE, NO_ADAPTER, PlaygroundView
from tests.views.conftest import GOLDEN, shown

MODEL = str(GOLDEN / "mixtral-f32.gguf")
ADAPTER = str(GOLDEN / "mixtral-lora.gguf")


@pytest.fixture(scope="module")
def engine():
    return load_model(MODEL), load_adapter(ADAPTER)


@pytest.fixture
def view(qtbot, ctx):
    return shown(qtbot, PlaygroundView(ctx))


def expected(engine, prompt, chat, n, adapter=None, scale=1.0, temperature=0.0, seed=0):
    model, _ = engine
    tok = model.tokenizer
    ids = chat_prompt_ids(tok, prompt) if chat else tok.encode(prompt)
    out = list(model.generate(ids, n, temperature, 1.0, seed, adapter, scale))
    return tok.decode(out), len(out)


def generate_and_wait(qtbot, view, timeout=30_000):
    with qtbot.waitSignal(view.finished, timeout=timeout):
        qtbot.mouseClick(view.generate_button, Qt.LeftButton)


def test_follows_the_selected_run(view, ctx, golden_run_dir):
    ctx.select_run(golden_run_dir)
    assert view.model_field.text() == MODEL
    assert view.adapter_source() == "run"
    assert view.adapter_key()[:2] == ("file", f"{golden_run_dir}/adapter.gguf")
    assert view.adapter_label.text() == f"Adapter: {golden_run_dir}/adapter.gguf"


def test_base_and_adapter_side_by_side(qtbot, view, ctx, golden_run_dir, engine):
    ctx.select_run(golden_run_dir)
    view.prompt.setPlainText("Hello")
    view.chat_box.setChecked(False)
    view.max_tokens.setValue(12)
    view.scale_slider.setValue(150)
    generate_and_wait(qtbot, view)
    base, n_base = expected(engine, "Hello", False, 12)
    tuned, n_tuned = expected(engine, "Hello", False, 12, engine[1], 1.5)
    assert view.base_output.toPlainText() == base
    assert view.adapter_output.toPlainText() == tuned
    assert base != tuned                               # the adapter changes the continuation
    assert view.adapter_title.text() == "With the adapter (scale 1.50)"
    assert f"{n_base} base and {n_tuned} adapter tokens" in view.status_label.text()
    assert not view.is_generating() and view.generate_button.isEnabled()


def test_chat_template_is_applied(qtbot, view, engine):
    view.model_field.setText(MODEL)
    view.source_box.setCurrentIndex(view.source_box.findData(NO_ADAPTER))
    view.prompt.setPlainText("Hi")
    view.max_tokens.setValue(8)
    generate_and_wait(qtbot, view)
    assert view.base_output.toPlainText() == expected(engine, "Hi", True, 8)[0]
    assert view.adapter_output.toPlainText() == ""
    assert view.adapter_title.text() == "With the adapter: none"


def test_streams_off_the_gui_thread_and_stops(qtbot, view, monkeypatch):
    import app.engine.model.transformer as model_mod

    seen, gate = [], threading.Event()
    original = model_mod.Model.generate

    def slow_generate(self, *args, **kwargs):
        for token in original(self, *args, **kwargs):
            seen.append(threading.current_thread())
            gate.wait(0.05)
            yield token

    monkeypatch.setattr(model_mod.Model, "generate", slow_generate)
    view.model_field.setText(MODEL)
    view.adapter_field.setText(ADAPTER)
    view.source_box.setCurrentIndex(view.source_box.findData(FROM_FILE))
    view.max_tokens.setValue(500)
    view.chat_box.setChecked(False)
    qtbot.mouseClick(view.generate_button, Qt.LeftButton)
    assert view.is_generating() and view.stop_button.isEnabled()
    qtbot.waitUntil(lambda: bool(view.base_output.toPlainText() and
                                 view.adapter_output.toPlainText()), timeout=20_000)  # both stream
    assert seen and all(t is not threading.main_thread() for t in seen)
    with qtbot.waitSignal(view.finished, timeout=10_000):
        qtbot.mouseClick(view.stop_button, Qt.LeftButton)
    assert "(stopped)" in view.status_label.text()
    assert len(seen) < 100                               # far from 2 x 500 tokens


def test_problems_go_to_the_error_panel(qtbot, view, ctx, tmp_path):
    view.model_field.setText(MODEL)
    view.source_box.setCurrentIndex(view.source_box.findData(FROM_FILE))
    view.adapter_field.setText(str(tmp_path / "missing.gguf"))
    qtbot.mouseClick(view.generate_button, Qt.LeftButton)
    assert view.error_panel.isVisibleTo(view)
    assert "missing.gguf" in view.error_panel.message_label.text()
    assert not view.is_generating()
    view.source_box.setCurrentIndex(view.source_box.findData("run"))   # no run selected
    assert view.adapter_label.text() == "No run is selected."
    not_an_adapter = tmp_path / "model-as-adapter.gguf"
    shutil.copy(MODEL, not_an_adapter)
    view.adapter_field.setText(str(not_an_adapter))
    view.source_box.setCurrentIndex(view.source_box.findData(FROM_FILE))
    generate_and_wait(qtbot, view)                      # fails in the thread: to the panel
    assert view.error_panel.title_label.text() == "Generation failed"
    assert "not a LoRA adapter" in view.error_panel.message_label.text()
