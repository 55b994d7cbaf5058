"""New run: model card and estimate, the dataset's lint report on screen, the settings form with
inline validation, save/load, and creating a queued run. QT_QPA_PLATFORM=offscreen (conftest)."""

import json
import re
import threading
import time
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from app.engine.data.dataset import DataConfig
from app.engine.data.lint import lint_file
from app.engine.model.lora import TARGET_GROUPS
from app.engine.model.card import describe_model, human_bytes, human_count, lora_param_count
from app.engine.runs.rundir import RunDir
from app.views.new_run.model_card import discover_models
from app.views.new_run.view import NewRunView
from tests.views.conftest import GOLDEN, SAMPLE_CHAT, SAMPLE_MODEL


@pytest.fixture
def view(new_run):
    return new_run


@pytest.fixture
def fake_gpu(monkeypatch):
    """Call it to make the app see a GPU (tests/fake_cupy.py)."""
    from tests import fake_cupy
    return lambda: fake_cupy.install(monkeypatch)


def wait_lint(qtbot, v):
    qtbot.wait(10)
    qtbot.waitUntil(lambda: not v.dataset.is_busy(), timeout=15_000)


def test_opens_with_the_sample_model_and_dataset_ready_to_start(view):
    assert view.model_path() == str(SAMPLE_MODEL)
    assert view.data_path() == str(SAMPLE_CHAT)
    assert view.problems() == []
    assert view.start_button.isEnabled() and view.queue_button.isEnabled()
    assert "tiny-moe.gguf" in view.summary_label.text()
    assert "chat.jsonl (300 rows, chat)" in view.summary_label.text()


def test_lint_report_on_screen(view):
    panel = view.dataset
    report = lint_file(str(SAMPLE_CHAT), str(SAMPLE_MODEL), DataConfig.from_dict(
        view.form.values()["data_config"]))
    assert panel.report.to_dict() == report.to_dict()
    # the histogram's bars are the linter's bins, the last one (longer than context) in red
    assert panel.histogram_heights() == [b["rows"] for b in report.histogram["bins"]]
    assert sum(panel.histogram_heights()) == report.accepted
    assert panel.context_line.value() == pytest.approx(report.histogram["fits_up_to"] + 0.5)
    # the example with every trained span highlighted
    spans = report.example["trained_spans"]
    shown = panel.highlighted_spans()
    assert len(shown) == len(spans) > 0
    text = report.example["text"]
    for (a, b), (sa, sb) in zip(shown, spans):
        assert a == sa and text[a:b].strip() == text[sa:sb].strip()
    assert panel.format_label.text() == "chat (detected)"
    assert "300 accepted, 0 rejected" in panel.summary_label.text()
    assert panel.bad_rows() == [] and panel.bad_rows_title.text() == "Rejected rows: none"
    # the preview: line numbers and the messages column
    t = panel.preview_table
    assert t.rowCount() == 30
    assert [t.horizontalHeaderItem(c).text() for c in range(t.columnCount())] == ["line",
                                                                                 "messages"]
    assert t.item(0, 1).text().startswith("user: What is 71 + 92? | assistant: Sure! 163")


def test_bad_rows_are_listed_with_line_and_reason(qtbot, view, tmp_path):
    data = tmp_path / "mixed.jsonl"
    good = SAMPLE_CHAT.read_text().splitlines()[:5]
    data.write_text("\n".join([good[0], "{not json", good[1], '{"messages": 3}', good[2]]) + "\n")
    view.dataset.set_data_path(str(data))
    wait_lint(qtbot, view)
    report = view.dataset.report
    assert report.rejected_count == 2
    assert view.dataset.bad_rows() == [(str(r.line), r.reason) for r in report.rejected]
    assert [line for line, _ in view.dataset.bad_rows()] == ["2", "4"]
    assert view.dataset.bad_rows_title.text() == "Rejected rows: 2"
    assert view.dataset.preview_table.item(1, 1).text() == "(not a JSON object)"


def test_a_dataset_with_no_usable_row_cannot_start(qtbot, view, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text("{oops\n[1, 2]\n")
    view.dataset.set_data_path(str(data))
    wait_lint(qtbot, view)
    assert view.dataset.report is None                 # nothing to detect a format from
    panel = view.dataset.error_panel
    assert panel.isVisibleTo(view.dataset) and "bad.jsonl" in panel.title_label.text()
    assert panel.message_label.text() == view.dataset.error.message
    assert any("cannot be used" in m for _, m in view.problems())
    assert not view.start_button.isEnabled()
    assert view.create_run() is None
    assert view.tabs.currentIndex() == 1               # the Dataset tab shows the problem


def test_target_checkboxes_show_parameter_counts(qtbot, view):
    form = view.form
    shapes = view.card.tensor_shapes
    for group, kinds in TARGET_GROUPS.items():
        if group in ("output", "embeddings"):        # not block tensors
            continue
        n = lora_param_count(shapes, 8, kinds)
        label = form.target_counts[group].text()
        if n:
            assert form.target_boxes[group].isEnabled()
            assert label == f"{human_count(n)} params \u00b7 {human_bytes(16 * n)}"
        else:                                       # the sample has no dense FFN, no shared
            assert label == "not in model" and not form.target_boxes[group].isEnabled()
    assert form.group_counts()["experts"] == lora_param_count(shapes, 8, TARGET_GROUPS["experts"])
    assert form.targets() == ["attention", "experts", "router"]
    assert form.trainable_params() == 341_248          # = the trainer's count (README run)
    assert form.trainable_label.text().startswith("341,248 LoRA parameters")
    form.target_boxes["router"].setChecked(False)
    assert form.trainable_params() == 341_248 - form.group_counts()["router"]


def in_float32(view) -> None:
    """Precision fp32 in the form: the expectations below are float32's (MemoryEstimate's
    formulas), whatever auto picks (WORKBENCH_PRECISION=bf16 forces it to bf16)."""
    view.form["precision"].setCurrentIndex(view.form["precision"].findData("fp32"))


def test_memory_estimate_follows_rank_context_and_targets(qtbot, view):
    in_float32(view)
    card = describe_model(str(SAMPLE_MODEL), 8, 256)
    adapter = view.form.trainable_params() * card.memory.adapter // card.lora_params
    qtbot.waitUntil(lambda: view.memory_estimate == card.memory.total_for(adapter),
                    timeout=5000)                             # default cache, no checkpointing
    first = view.memory_estimate
    view.form["checkpoint_interval"].setValue(1)
    qtbot.waitUntil(lambda: view.memory_estimate == card.memory.total_for(adapter, 1),
                    timeout=5000)
    assert view.memory_estimate < first and "checkpoint every 1 layers" in view.memory_label.text()
    view.form["checkpoint_interval"].setValue(0)
    qtbot.waitUntil(lambda: view.memory_estimate == first, timeout=5000)
    assert "no checkpointing" in view.memory_label.text()
    view.form["rank"].setValue(64)
    qtbot.waitUntil(lambda: view.memory_estimate != first, timeout=5000)
    assert view.memory_estimate > first
    assert "Estimated memory" in view.memory_label.text()
    rows = dict(view.card_view.shown_rows())
    assert "Estimated memory (current settings)" in rows        # the card's row is live too
    bigger = view.memory_estimate
    view.form.target_boxes["experts"].setChecked(False)
    qtbot.waitUntil(lambda: view.memory_estimate < bigger, timeout=5000)
    smaller = view.memory_estimate
    view.form["context"].setValue(64)
    qtbot.waitUntil(lambda: view.memory_estimate < smaller, timeout=5000)


def test_full_finetuning_has_a_memory_estimate(qtbot, view):
    in_float32(view)
    card = describe_model(str(SAMPLE_MODEL), 8, 256)
    adapter = view.form.trainable_params() * card.memory.adapter // card.lora_params
    qtbot.waitUntil(lambda: view.memory_estimate == card.memory.total_for(adapter),
                    timeout=5000)
    lora = view.memory_estimate
    view.form["mode"].setCurrentIndex(view.form["mode"].findData("full"))
    want = card.memory.total_for(16 * card.full_params)
    qtbot.waitUntil(lambda: view.memory_estimate == want, timeout=5000)
    assert card.full_params == card.n_params                   # the sample model is all F32
    assert view.memory_estimate > lora and "trained copies" in view.memory_label.text()


def test_compute_device_choice_checks_for_a_gpu_and_shows_its_memory(qtbot, view, fake_gpu):
    form = view.form
    form["device"].setCurrentIndex(form["device"].findData("cuda"))
    assert "no usable CUDA GPU" in form.errors()["device"]
    qtbot.waitUntil(lambda: "no usable CUDA GPU here" in view.memory_label.text(), timeout=5000)
    fake_gpu()                                      # the CuPy stand-in: one 16 GB device
    form["seed"].setValue(form["seed"].value() + 1)    # any change re-validates
    assert "device" not in form.errors()
    form["device"].setCurrentIndex(form["device"].findData("cpu"))
    form["device"].setCurrentIndex(form["device"].findData("cuda"))
    qtbot.waitUntil(lambda: "GPU memory 16" in view.memory_label.text(), timeout=5000)
    assert view.config_dict()["train"]["device"] == "cuda"


def test_inline_validation(qtbot, view):
    form = view.form
    form["lr"].setText("abc")
    assert form.errors()["lr"] == "Enter a number, e.g. 1e-4 or 0.0005."
    assert form.error_labels["lr"].isVisibleTo(form)
    assert not view.start_button.isEnabled()
    form["lr"].setText("2")
    assert "diverges" in form.errors()["lr"]
    form["lr"].setText("1e-3")
    assert "lr" not in form.errors() and not form.error_labels["lr"].isVisibleTo(form)
    for box in form.target_boxes.values():
        box.setChecked(False)
    assert form.errors()["targets"] == "Pick at least one target for the adapters."
    form.target_boxes["attention"].setChecked(True)
    form["epochs"].setValue(0)
    assert "epochs" in form.errors()
    form["max_steps"].setValue(10)
    assert "epochs" not in form.errors()
    form["warmup"].setValue(10)
    assert form.errors()["warmup"] == "Warmup must be shorter than the run's steps."
    form["warmup"].setValue(2)
    form["context"].setValue(1024)                   # the sample was trained with 256
    assert "256" in form.errors()["context"]
    form["context"].setValue(128)
    form["weights_source"].setCurrentIndex(form["weights_source"].findData("file"))
    assert form.errors()["weights_path"].startswith("Choose the weights file")
    form.weights_path.setText("/no/such/file.txt")
    assert form.errors()["weights_path"] == "There is no file /no/such/file.txt."
    form["weights_source"].setCurrentIndex(form["weights_source"].findData("row"))
    form["normalize"].setCurrentIndex(form["normalize"].findData("clip"))
    form.clip_lo.setValue(2)
    form.clip_hi.setValue(1)
    assert "lower bound" in form.errors()["clip"]
    form.clip_hi.setValue(3)
    form["mode"].setCurrentIndex(form["mode"].findData("hybrid"))
    assert "full_targets" in form.errors()
    form.full_boxes["norms"].setChecked(True)
    assert form.errors() == {}
    assert view.problems() == [] and view.start_button.isEnabled()
    view.name_field.setText("bad/name")
    assert not view.start_button.isEnabled()


def test_settings_change_the_lint(qtbot, view):
    view.form["context"].setValue(64)
    wait_lint(qtbot, view)
    report = view.dataset.report
    assert report.context == 64
    assert report.histogram["over_context"] > 0
    assert view.dataset.histogram_heights()[-1] == report.histogram["over_context"]


def test_rows_dropped_for_overflow_are_not_counted_as_training_rows(qtbot, view,
                                                                    monkeypatch):
    """Issue 29 item 3: with overflow 'drop', rows longer than the context train nothing; the
    Dataset tab, the summary, the steps estimate and the mostly-unusable question counted them
    as accepted rows (the linter's own text says 'N accepted, M dropped')."""
    from PySide6.QtWidgets import QMessageBox
    form = view.form
    form["overflow"].setCurrentIndex(form["overflow"].findData("drop"))
    form["packing"].setCurrentIndex(form["packing"].findData("none"))
    form["context"].setValue(64)
    wait_lint(qtbot, view)
    r = view.dataset.report
    assert r.overflow == "drop" and 0 < r.dropped < r.accepted
    assert r.training_rows == r.accepted - r.dropped == r.to_dict()["training_rows"]
    assert (f"{r.rows:,} rows: {r.training_rows:,} accepted, {r.dropped:,} dropped as longer "
            f"than the context, 0 rejected") in view.dataset.summary_label.text()
    assert (f"chat.jsonl ({r.training_rows:,} rows, {r.dropped:,} dropped for overflow, chat)"
            in view.summary_label.text())
    assert form.train_windows == max(1, round(r.training_rows * (1 - form["val_split"].value())))

    form["context"].setValue(32)                     # now most rows are dropped: Start asks
    wait_lint(qtbot, view)
    r = view.dataset.report
    assert r.dropped * 2 > r.rows and r.rejected_count == 0
    asked = []
    monkeypatch.setattr(QMessageBox, "question",
                        lambda *a, **k: asked.append(a[2]) or QMessageBox.No)
    assert view.create_run() is None and asked
    assert (f"{r.dropped:,} of the {r.rows:,} rows of chat.jsonl cannot be used; the run would "
            f"train on {r.training_rows:,}") in asked[0]
    assert f"{r.dropped:,} longer than the context (32 positions), dropped" in asked[0]

    form["context"].setValue(16)                     # every row dropped: Start cannot start
    wait_lint(qtbot, view)
    assert view.dataset.report.training_rows == 0 and not view.start_button.isEnabled()
    assert ("dataset", "No row of the dataset fits the context: all 300 are longer and "
            "dropped (Rows longer than context).") in view.problems()


def test_lint_runs_off_the_gui_thread(qtbot, ctx):
    release = threading.Event()
    threads = []

    def slow_lint(*args, **kwargs):
        threads.append(threading.current_thread())
        release.wait(10)
        return lint_file(*args, **kwargs)

    v = NewRunView(ctx, discover=lambda: [], lint=slow_lint)
    qtbot.addWidget(v)
    qtbot.waitUntil(lambda: bool(threads), timeout=10_000)
    assert threads[0] is not threading.main_thread()
    assert v.dataset.is_busy() and v.dataset.busy.isVisibleTo(v.dataset)
    t0 = time.monotonic()
    qtbot.wait(50)                                     # the event loop runs meanwhile
    assert time.monotonic() - t0 < 1.0
    release.set()
    qtbot.waitUntil(lambda: v.dataset.report is not None, timeout=10_000)


def test_save_and_load_settings(qtbot, view, ctx, tmp_path):
    view.form["rank"].setValue(4)
    view.form["lr"].setText("3e-4")
    view.form["schedule"].setCurrentIndex(view.form["schedule"].findData("cosine"))
    view.form.target_boxes["attention"].setChecked(False)
    path = tmp_path / "settings.json"
    view.save_settings(str(path))
    saved = json.loads(path.read_text())
    assert saved["train"]["lora_rank"] == 4 and saved["train"]["lr"] == 3e-4
    assert saved["model"] == str(SAMPLE_MODEL) and saved["data"] == str(SAMPLE_CHAT)
    view.form.set_values({})                            # back to the defaults
    assert view.form["rank"].value() == 8
    view.load_settings(str(path))
    assert view.form["rank"].value() == 4 and view.form["lr"].text() == "0.0003"
    assert view.form["schedule"].currentData() == "cosine"
    assert view.form.targets() == ["experts", "router"]
    assert view.form.values() == {k: v for k, v in saved.items() if k not in ("model", "data")}

    errors = []
    ctx.error_reported.connect(lambda title, e, context: errors.append((title, e)))
    bad = tmp_path / "bad.json"
    bad.write_text('{"train": {"no_such_setting": 1}}')
    view.load_settings(str(bad))
    assert errors and errors[-1][0] == "Could not load the settings"
    assert "no_such_setting" in errors[-1][1].message
    bad.write_text("{oops")
    view.load_settings(str(bad))
    assert "Could not read bad.json" in errors[-1][1].message


def test_repeating_a_run_keeps_the_settings_the_screen_does_not_show(qtbot, view, tmp_path):
    """A run's config.json made on the command line may hold settings New run has no field
    for (global-norm clipping, AdamW betas, the weight cache, an adapter to start from...):
    loading it to repeat the run keeps them; the screen's own fields still win."""
    from app.engine.training.sft import RunConfig

    cli = RunConfig.from_dict({"model": str(SAMPLE_MODEL), "data": str(SAMPLE_CHAT),
                               "keep_last": 2, "train": {"max_grad_norm": 1.0, "beta2": 0.99,
                                                         "weight_cache_mb": 0, "lora_rank": 4}})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cli.to_dict()))
    view.load_settings(str(path))
    view.form["rank"].setValue(6)                            # a field of the screen: it wins
    cfg = view.build_config()
    assert (cfg.keep_last, cfg.train.max_grad_norm, cfg.train.beta2) == (2, 1.0, 0.99)
    assert cfg.train.weight_cache_mb == 0 and cfg.train.lora_rank == 6
    assert cfg.train.min_lr == cli.train.min_lr and cfg.max_bad_steps == cli.max_bad_steps
    view.set_run_type("grpo")                                # another run type: not carried
    assert view.config_dict()["train"]["beta2"] == 0.999


def test_start_now_creates_queues_and_selects_the_run(qtbot, view, ctx):
    navigated, selected = [], []
    ctx.navigate.connect(navigated.append)
    ctx.run_selected.connect(selected.append)
    other = RunDir.create(ctx.runs_root() / "waiting", {"model": "m", "data": "d"})
    ctx.queue.add(other.path, check=False)
    view.name_field.setText("my first run")
    with qtbot.waitSignal(view.run_created, timeout=10_000):
        qtbot.mouseClick(view.start_button, Qt.LeftButton)
        assert not view.start_button.isEnabled()       # created off the GUI thread
    path = ctx.current_run
    assert path == str(ctx.runs_root() / "my first run")
    assert selected == [path] and navigated == ["monitor"]
    assert ctx.worker_starts == [1]                      # ctx.ensure_worker() was called
    config = RunDir(path).config()                       # the whole RunConfig, resolved
    assert config["model"] == str(SAMPLE_MODEL) and config["data"] == str(SAMPLE_CHAT)
    assert config["train"]["lora_rank"] == 8 and config["train"]["lr"] == 5e-3
    assert config["train"]["lora_targets"] == ["attention", "experts", "router"]
    assert config["data_config"]["context"] == 256 and config["epochs"] == 3
    assert config["keep_last"] == 2                      # defaults the form does not show
    jobs = ctx.queue.list("queued")
    assert [j.run_dir for j in jobs] == [path, str(other.path)]   # Start now goes first
    assert view.name_field.text() == ""


def test_queue_run_goes_last_and_shows_runs(qtbot, view, ctx):
    navigated = []
    ctx.navigate.connect(navigated.append)
    with qtbot.waitSignal(view.run_created, timeout=10_000):
        first = view.create_run(start=False)
        assert view.create_run(start=False) is None    # one at a time
    with qtbot.waitSignal(view.run_created, timeout=10_000):
        second = view.create_run(start=False)
    # two default names: date-time-dataset, the second with "-2" when made in the same second
    pattern = re.compile(r"\d{8}-\d{6}-chat(-\d+)?")
    assert first != second and all(pattern.fullmatch(Path(p).name) for p in (first, second))
    assert [j.run_dir for j in ctx.queue.list("queued")] == [first, second]
    assert navigated == ["runs", "runs"]


def test_a_queue_error_goes_to_the_funnel(qtbot, view, ctx, monkeypatch):
    errors = []
    ctx.error_reported.connect(lambda title, e, context: errors.append((title, e)))

    def broken(*a, **k):
        from app.engine.runs.queue import QueueError

        raise QueueError("The job queue is locked.", "Try again.")

    monkeypatch.setattr(ctx.queue, "add", broken)
    path = view.create_run()
    qtbot.waitUntil(lambda: bool(errors), timeout=10_000)
    assert errors[0][0] == "Could not queue the run" and errors[0][1].hint == "Try again."
    assert ctx.current_run is None and not view.is_creating()
    assert view.start_button.isEnabled()
    assert Path(path, "config.json").is_file()          # the folder stays, unqueued


def test_start_refuses_a_folder_that_holds_runs_as_the_cli_does(qtbot, view, ctx, tmp_path,
                                                                capsys, monkeypatch):
    """Issue 29 item 7: a run folder around other runs (deleting it would take them along) was
    refused by `workbench train -o` only; the window's Start made it. One engine check now
    (RunDir.create), the same message on both."""
    from app.cli.main import run_cli
    archive = ctx.runs_root() / "archive"
    inner = RunDir.create(archive / "old-run", {"name": "old-run"}).path
    errors = []
    ctx.error_reported.connect(lambda title, e, context: errors.append((title, e)))
    view.name_field.setText("archive")
    assert view.run_dir_for("archive").name == "archive-2"   # a name never reuses a folder...
    monkeypatch.setattr(view, "run_dir_for", lambda name="": archive)   # ... made meanwhile
    assert view.create_run() is not None
    qtbot.waitUntil(lambda: bool(errors), timeout=10_000)
    title, error = errors[0]
    assert title == "Could not queue the run"
    assert error.message == f"{archive} holds the run {inner}."
    assert error.hint == "Choose an output folder that holds no run."
    assert not (archive / "config.json").exists() and ctx.queue.list() == []
    assert run_cli(["train", "-m", str(SAMPLE_MODEL), "-d", str(SAMPLE_CHAT), "-o",
                    str(archive), "--queue", str(tmp_path / "q.sqlite3")]) == 2
    assert f"error: {error.message}" in capsys.readouterr().err


def test_models_found_in_the_usual_places(tmp_path):
    home = tmp_path / "home"
    (home / ".cache" / "llama.cpp").mkdir(parents=True)
    (home / ".cache" / "llama.cpp" / "Qwen3-0.6B-Q8_0.gguf").write_bytes(b"x" * 10)
    (home / ".cache" / "llama.cpp" / "mmproj-vision.gguf").write_bytes(b"x")
    lms = home / ".lmstudio" / "models" / "lmstudio-community" / "OLMoE-GGUF"
    lms.mkdir(parents=True)
    (lms / "olmoe-Q4_K_M.gguf").write_bytes(b"x" * 20)
    ollama = home / ".ollama" / "models"
    (ollama / "blobs").mkdir(parents=True)
    (ollama / "blobs" / "sha256-abc123").write_bytes(b"x" * 30)
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "mixtral" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:t"},
        {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:abc123"}]}))
    found = discover_models(home, env={})
    assert [(m.name, m.source, m.size) for m in found] == [
        ("Qwen3-0.6B-Q8_0.gguf", "llama.cpp cache", 10),
        ("olmoe-Q4_K_M.gguf", "LM Studio", 20),
        ("mixtral:latest", "Ollama", 30)]
    assert found[2].path == str(ollama / "blobs" / "sha256-abc123")
    assert discover_models(tmp_path / "empty", env={}) == []


def test_found_models_are_listed_and_open(qtbot, ctx):
    from app.views.new_run.model_card import FoundModel

    mixtral = str(GOLDEN / "mixtral-q4_0.gguf")
    v = NewRunView(ctx, discover=lambda: [FoundModel(mixtral, "mixtral:latest", "Ollama", 1)])
    qtbot.addWidget(v)
    lst = v.picker.found_list
    qtbot.waitUntil(lambda: lst.count() == 1, timeout=5000)
    assert lst.item(0).text().startswith("mixtral:latest\nOllama")
    v.picker._picked(lst.item(0))
    qtbot.waitUntil(lambda: v.card is not None and v.card.path == mixtral, timeout=10_000)


def test_presets_set_the_fields_and_say_what_they_set(qtbot, view, settings):
    from app.views.new_run.preset_bar import PRESETS, PresetBar

    bar = view.presets
    names = [bar.box.itemText(i) for i in range(bar.box.count())]
    assert names[1:] == list(PRESETS)                    # the sample is MoE: all five
    bar.apply("Thorough")
    form = view.form
    # the engine's rule for alpha 64 (default_lr), its schedule and its global-norm clipping
    assert (form["rank"].value(), form["alpha"].value(), form["lr"].text()) == (32, 64.0, "0.0025")
    assert form["schedule"].currentData() == "cosine" and form["gclip"].value() == 0.0
    assert form["epochs"].value() == 5 and form["patience"].value() == 3
    assert bar.line.text().startswith("Thorough: Sets ")
    assert "rank 32" in bar.line.text() and "learning rate 0.0025" in bar.line.text()
    assert "gradient-norm clip 1" in bar.line.text()
    bar.apply("Experts only")
    assert form.targets() == ["experts"]
    assert "LoRA rank 8 on experts" in view.summary_label.text()
    form["rank"].setValue(12)                            # the user's own
    bar.save("Mine")
    again = PresetBar(view.form, settings)               # kept in the settings
    qtbot.addWidget(again)
    assert again.box.findText("Mine") > 0
    form["rank"].setValue(4)
    again.apply("Mine")
    assert form["rank"].value() == 12 and form.targets() == ["experts"]
    bar.set_moe(False)                                   # a dense model: no expert presets
    assert bar.box.findText("Experts only") < 0 and bar.box.findText("Balanced") > 0


def test_every_field_has_a_tooltip(view):
    from tests.views.conftest import untipped_inputs

    assert untipped_inputs(view) == []
    assert "--rank" in view.form["rank"].toolTip() and "Typical" in view.form["lr"].toolTip()


def test_visual_details(qtbot, view):
    view.tabs.setCurrentIndex(1)
    stats = view.dataset.hist_stats.text()
    p95 = stats.split("p95 ", 1)[1].split(",", 1)[0]
    assert p95.isdigit()                                 # tokens: an integer
    assert "Context 256: a row of up to 257 tokens trains whole (256 predicted" in stats
    field = view.name_field                              # the placeholder is not cut
    assert field.width() >= field.fontMetrics().horizontalAdvance(field.placeholderText()) + 40
    assert view.picker.path_field.cursorPosition() == 0  # the path from its start


def test_targets_llamacpp_cannot_load_are_refused_before_a_run_exists(view, ctx):
    """The CLI's start-of-run rule (app.engine.model.lora.check_targets) runs where the window
    queues a run: a target that matches nothing on the model (the sample has no shared experts;
    the form only offers the model's groups, a loaded config may name others) queues nothing."""
    import dataclasses

    from app.engine.api import ConfigError

    config = view.build_config()
    config = dataclasses.replace(config, train=dataclasses.replace(config.train,
                                                                   lora_targets=("shared",)))
    path = ctx.runs_root() / "refused"
    with pytest.raises(ConfigError, match="This model's targets"):
        view._check_and_queue(path, config, False)
    assert ctx.queue.list("queued") == [] and not path.exists()


def test_the_estimate_follows_the_precision(qtbot, view, monkeypatch):
    """Under --precision bf16 the weight cache holds the quantized weights packed in bf16, half
    their float32 bytes; the sentence says so (issue 30). The NumPy emulation, so that the
    library's own memory (BF16_LIBRARY_BYTES) does not count on a CPU with the unit."""
    from app.engine.runtime import bf16

    monkeypatch.setattr(bf16, "_device", bf16.Device(None, False))
    path = str(GOLDEN / "qwen3moe-q4_0.gguf")
    view.open_model(path)
    qtbot.waitUntil(lambda: view.card is not None and view.card.path == path, timeout=5000)
    view.form["precision"].setCurrentIndex(view.form["precision"].findData("fp32"))
    qtbot.waitUntil(lambda: "packed" not in view.memory_label.text()
                    and "dequantized" in view.memory_label.text(), timeout=5000)
    fp32 = view.memory_estimate
    view.form["precision"].setCurrentIndex(view.form["precision"].findData("bf16"))
    qtbot.waitUntil(lambda: view.memory_estimate != fp32, timeout=5000)
    card = describe_model(path, 8, 256)
    assert view.memory_estimate == fp32 - card.memory.dequantized // 2
    assert "(packed bf16" in view.memory_label.text()
    # the card's row follows too (it stayed at the first estimate of the screen before)
    rows = dict(view.card_view.shown_rows())
    assert rows["Estimated memory (current settings)"] == view.memory_label.text().split(": ", 1)[1]
    view.grab().save("/tmp/shots/new_run_bf16_estimate.png")
