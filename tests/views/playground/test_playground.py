"""Playground: a multi-turn chat with the base model and the adapter side by side, streaming in
a thread, stoppable; the adapter of the selected run (its best checkpoint by default) or a
file; the conversation clears when the run or the adapter changes. (offscreen: conftest)"""

import shutil
import threading

import pytest
from PySide6.QtCore import Qt

from app.engine import load_adapter, load_model
from app.engine.api import RunDir
from app.engine.text.chat_template import generation_prompt_ids
from app.views.playground.view import FROM_FILE, NO_ADAPTER, PlaygroundView
from app.views.widgets.run_best import BEST
from tests.views.conftest import GOLDEN, shown, untipped_inputs

MODEL = str(GOLDEN / "mixtral-f32.gguf")
ADAPTER = str(GOLDEN / "mixtral-lora.gguf")


@pytest.fixture(scope="module")
def engine():
    return load_model(MODEL), load_adapter(ADAPTER)


@pytest.fixture
def view(qtbot, ctx):
    return shown(qtbot, PlaygroundView(ctx), 1280, 800)


def expected(engine, prompt, chat, n, adapter=None, scale=1.0, temperature=0.0, seed=0):
    """The answer to `prompt`: a list of chat messages, or a text (no template)."""
    model, _ = engine
    tok = model.tokenizer
    ids = generation_prompt_ids(tok, prompt) if chat else tok.encode(prompt)
    out = list(model.generate(ids, n, temperature, 1.0, seed, adapter, scale))
    return tok.decode(out), len(out)


def mark(n, limit):
    """What the pane shows after an answer of n tokens with Max tokens at `limit`."""
    cut = f" \u2026 [stopped at {limit} tokens: raise Max tokens to see more]"
    return cut if n == limit else ""


def send_and_wait(qtbot, view, text, timeout=30_000):
    view.message.setPlainText(text)
    with qtbot.waitSignal(view.finished, timeout=timeout):
        qtbot.mouseClick(view.send_button, Qt.LeftButton)


def test_follows_the_selected_run(view, ctx, golden_run_dir):
    ctx.select_run(golden_run_dir)
    assert view.model_field.text() == MODEL
    assert view.adapter_source() == "run"
    assert view.adapter_key()[:2] == ("file", f"{golden_run_dir}/adapter.gguf")
    assert view.adapter_label.text() == "Adapter: Final adapter (adapter.gguf) of golden"


def test_the_best_checkpoint_is_the_default(view, ctx, best_run_dir):
    ctx.select_run(best_run_dir)
    assert view.checkpoint_box.currentData() == BEST
    assert view.checkpoint_box.currentText() == "Best checkpoint, step 10 (validation 1.37)"
    assert view.adapter_key() == ("run", best_run_dir, 10)
    items = [view.checkpoint_box.itemData(i) for i in range(view.checkpoint_box.count())]
    assert items == [BEST, "final", "20"]        # any kept checkpoint can be picked, each once
    view.checkpoint_box.setCurrentIndex(items.index("20"))
    assert view.adapter_key() == ("run", best_run_dir, 20)


def checkpoint_list(view):
    box = view.checkpoint_box
    return [(box.itemData(i), box.itemText(i)) for i in range(box.count())]


@pytest.mark.parametrize("final", [10, 20])
def test_each_checkpoint_is_listed_once(view, ctx, best_run_dir, final):
    """The best checkpoint (step 10) is not listed again as a step; a finished run's final
    adapter is its last step, so that step is not listed again either."""
    RunDir(best_run_dir).write_status(state="done", step=final)
    ctx.select_run(best_run_dir)
    if final == 10:                                  # the best is the last step
        assert checkpoint_list(view) == [
            (BEST, "Best checkpoint, step 10 (validation 1.37), also the final adapter"),
            ("20", "Checkpoint at step 20")]
    else:
        assert checkpoint_list(view) == [(BEST, "Best checkpoint, step 10 (validation 1.37)"),
                                         ("final", "Final adapter (adapter.gguf), step 20")]
    assert view.adapter_key() == ("run", best_run_dir, 10)


def test_base_and_adapter_side_by_side(qtbot, view, ctx, golden_run_dir, engine):
    ctx.select_run(golden_run_dir)
    view.chat_box.setChecked(False)
    view.max_tokens.setValue(12)
    view.scale_slider.setValue(150)
    send_and_wait(qtbot, view, "Hello")
    base, n_base = expected(engine, "Hello", False, 12)
    tuned, n_tuned = expected(engine, "Hello", False, 12, engine[1], 1.5)
    assert view.base_output.toPlainText() == f"You: Hello\n\nModel: {base}{mark(n_base, 12)}"
    assert view.adapter_output.toPlainText() == (f"You: Hello\n\nModel: {tuned}"
                                                 f"{mark(n_tuned, 12)}")
    assert base != tuned
    assert view.adapter_title.text() == "With the adapter (scale 1.50)"
    assert f"{n_base} base and {n_tuned} adapter tokens" in view.status_label.text()
    assert not view.is_generating() and view.send_button.isEnabled()


def test_a_multi_turn_chat_keeps_its_history_and_clears_on_a_run_change(
        qtbot, view, ctx, golden_run_dir, best_run_dir, engine):
    ctx.select_run(golden_run_dir)
    view.view_box.setCurrentIndex(view.view_box.findData("base"))     # toggled: the base alone
    assert not view.adapter_output.isVisibleTo(view)
    view.system_prompt.setPlainText("Be brief.")
    view.max_tokens.setValue(6)
    send_and_wait(qtbot, view, "Hi")
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    answer, _ = expected(engine, first, True, 6)
    send_and_wait(qtbot, view, "And then?")
    second = first + [{"role": "assistant", "content": answer},
                      {"role": "user", "content": "And then?"}]
    answer2, n2 = expected(engine, second, True, 6)
    assert view.histories["base"] == second[1:] + [{"role": "assistant", "content": answer2}]
    assert view.histories["adapter"] == []
    assert view.base_output.toPlainText().endswith(f"You: And then?\n\nModel: {answer2}"
                                                   f"{mark(n2, 6)}")
    ctx.select_run(best_run_dir)                         # another run: no stale answers
    assert view.histories == {"base": [], "adapter": []}
    assert view.base_output.toPlainText() == view.adapter_output.toPlainText() == ""
    send_and_wait(qtbot, view, "Hi")
    view.clear_button.click()
    assert view.histories["base"] == [] and view.base_output.toPlainText() == ""


def test_an_answer_cut_at_max_tokens_is_marked(qtbot, view, ctx, golden_run_dir, engine):
    ctx.select_run(golden_run_dir)
    view.max_tokens.setValue(3)
    send_and_wait(qtbot, view, "Hi")
    answer, n = expected(engine, [{"role": "user", "content": "Hi"}], True, 3)
    assert n == 3
    assert view.base_output.toPlainText() == f"You: Hi\n\nModel: {answer}{mark(3, 3)}"
    assert view.adapter_output.toPlainText().endswith(mark(3, 3))
    assert view.histories["base"][-1] == {"role": "assistant", "content": answer}   # not sent back
    cursor = view.base_output.textCursor()
    cursor.movePosition(cursor.MoveOperation.End)
    assert cursor.charFormat().fontItalic()                                # muted, not the text


def test_an_answer_ending_on_a_stop_token_is_not_marked(qtbot, view, ctx, golden_run_dir,
                                                        engine, monkeypatch):
    import app.engine.model.transformer as model_mod

    prompt = [{"role": "user", "content": "Hi"}]
    model = engine[0]
    third = list(model.generate(generation_prompt_ids(model.tokenizer, prompt), 3, 0.0, 1.0, 0,
                                None, 1.0))[2]
    original = model_mod.Model.generate

    def stop_on_the_third(self, ids, n, *args):      # the third token stands for end-of-sequence
        return original(self, ids, n, *args[:-1], [third])

    monkeypatch.setattr(model_mod.Model, "generate", stop_on_the_third)
    ctx.select_run(golden_run_dir)
    view.view_box.setCurrentIndex(view.view_box.findData("base"))
    view.max_tokens.setValue(3)
    send_and_wait(qtbot, view, "Hi")
    answer, _ = expected(engine, prompt, True, 2)
    assert view.base_output.toPlainText() == f"You: Hi\n\nModel: {answer}"      # no mark


def test_every_input_has_a_tooltip(view):
    assert untipped_inputs(view) == []


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
    view.message.setPlainText("Hello")
    qtbot.mouseClick(view.send_button, Qt.LeftButton)
    assert view.is_generating() and view.stop_button.isEnabled()
    qtbot.waitUntil(lambda: not any(v.toPlainText().endswith("Model: ")       # both stream
                                    for v in (view.base_output, view.adapter_output)),
                    timeout=20_000)
    assert seen and all(t is not threading.main_thread() for t in seen)
    with qtbot.waitSignal(view.finished, timeout=10_000):
        qtbot.mouseClick(view.stop_button, Qt.LeftButton)
    assert "(stopped)" in view.status_label.text()
    assert len(seen) < 100                               # far from 2 x 500 tokens


def test_problems_go_to_the_error_panel(qtbot, view, ctx, tmp_path):
    view.model_field.setText(MODEL)
    view.source_box.setCurrentIndex(view.source_box.findData(FROM_FILE))
    view.adapter_field.setText(str(tmp_path / "missing.gguf"))
    qtbot.mouseClick(view.send_button, Qt.LeftButton)
    assert view.error_panel.isVisibleTo(view)
    assert "missing.gguf" in view.error_panel.message_label.text()
    assert not view.is_generating()
    view.source_box.setCurrentIndex(view.source_box.findData("run"))   # no run selected
    assert view.adapter_label.text() == "No run is selected."
    not_an_adapter = tmp_path / "model-as-adapter.gguf"
    shutil.copy(MODEL, not_an_adapter)
    view.adapter_field.setText(str(not_an_adapter))
    view.source_box.setCurrentIndex(view.source_box.findData(FROM_FILE))
    send_and_wait(qtbot, view, "Hello")                 # fails in the thread: to the panel
    assert view.error_panel.title_label.text() == "Generation failed"
    assert "not a LoRA adapter" in view.error_panel.message_label.text()
