"""Screenshots of every screen of the real app, for the docs.

    QT_QPA_PLATFORM=offscreen python -m tools.screenshots docs/screenshots

Every screen is taken at each `--size` (default 1280x800 and 1920x1080): the first size's files
have the plain names the docs use (`monitor.png`), the others a suffix with their width
(`monitor-1920.png`).

Opens the window on a private queue, runs folder and settings (nothing of the user's is
touched), with the bundled sample model and dataset; shoots the New run tabs and its "Get a
model..." dialog (over a loopback test Hub); adds two
example clusters (no token: nothing reaches the keyring) and shoots Settings > Clusters and New
run with "Run on" a cluster, and the Dataset tab in the dark theme (`new-run-dataset-dark`),
New run with DPO chosen on the sample preferences (`new-run-dpo`: its Dataset tab with a pair,
`new-run-dpo-training`: its fields; `--quick` stops there); starts a short real run (on this computer) in a real worker process; shoots Monitor (also dark: `monitor-dark`) and Experts when it has finished; exports a
GGUF adapter and chats two turns in the Playground; evaluates the base and the run's adapter
on the sample suite and tasks (Evaluate, through the worker); shoots those. Then the GRPO
addition demo: its New run tabs, a real 40-step run, Monitor's Rewards and Completions pages; a 40-step DPO run
on the sample preferences, in Monitor (`monitor-dpo`: loss, accuracy, margin); then Runs (all
three runs) and an error. The worker it started is stopped at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

SIZES = ((1280, 800), (1920, 1080))
CLUSTER = "lab-gpus"            # an example cluster for the Settings and Run on screenshots


def add_example_clusters(ctx, runs_root: str) -> None:
    """Two clusters in the window's private store: a lab's GPU head whose path map covers the
    runs folder, and a head on this machine."""
    from app.engine.api import Cluster, PathMap

    store = ctx.clusters()
    store.save(Cluster(CLUSTER, "http://gpu-head.lab:8265",
                       PathMap.parse(f"{runs_root}=/mnt/shared/workbench/runs"),
                       "/opt/workbench/.venv/bin/python", 8, 1))
    store.save(Cluster("this-machine", "http://127.0.0.1:8265"))
    ctx.clusters_changed.emit()


def shoot_get_model(new_run, out: Path, wait, pump) -> None:
    """The "Get a model..." dialog (New run's model picker) over the test Hub's tiny
    repositories (tests/hub_server.py on loopback: nothing leaves this machine), a split and a
    one-file model listed with what fits here."""
    from tests.hub_server import FakeHub, build_repos

    names = ("HF_ENDPOINT", "HF_HOME", "HF_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE")
    saved = {k: os.environ.get(k) for k in names}
    with tempfile.TemporaryDirectory(prefix="workbench-hub-") as tmp, \
            FakeHub(build_repos(Path(tmp) / "repos")) as hub:
        for k in names:
            os.environ.pop(k, None)
        os.environ.update(HF_ENDPOINT=hub.url, HF_HOME=os.path.join(tmp, "hf"))
        try:
            new_run.picker.get_model()
            dialog = new_run.picker.get_dialog
            dialog.query.setText("tiny")
            dialog.search()
            wait(lambda: dialog.results.rowCount() > 0, "the Hub's search", 30)
            dialog.select_repo("wb-test/tiny-mixtral-GGUF")
            wait(lambda: dialog.models and len(dialog.fits) == len(dialog.models),
                 "what fits", 30)
            dialog.select_file("tiny-mixtral-Q8_0.gguf")
            pump(0.4)
            path = out / "get-model.png"
            dialog.grab().save(str(path))
            print(f"wrote {path}")
            dialog.reject()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def shoot_new_run_dpo(new_run, wait, shoot) -> None:
    """New run with the run type DPO on sample_data/preferences.jsonl: the Dataset tab showing
    the pairs and one pair (`new-run-dpo`), the Training tab with DPO's fields
    (`new-run-dpo-training`); then back to a supervised run on the dataset it had."""
    sample = Path(__file__).resolve().parents[1] / "sample_data"
    data = new_run.data_path()
    new_run.set_run_type("dpo")
    new_run.dataset.set_data_path(str(sample / "preferences.jsonl"))
    wait(lambda: new_run.dataset.pair_report is not None and not new_run.dataset.is_busy(),
         "the preference pairs' check")
    for i, name in ((1, "new-run-dpo"), (2, "new-run-dpo-training")):
        new_run.tabs.setCurrentIndex(i)
        shoot(name)
    new_run.set_run_type("sft")
    new_run.dataset.set_data_path(data)
    wait(lambda: new_run.dataset.report is not None and not new_run.dataset.is_busy(),
         "the dataset's check")
    new_run.tabs.setCurrentIndex(0)


def shoot_preference_run(ctx, window, pump, shoot) -> None:
    """A short DPO run on sample_data/preferences.jsonl, trained here (in this process, so the
    shot does not wait on the worker), followed in Monitor: `monitor-dpo` (loss, accuracy and
    margin)."""
    from app.engine.runs.reporter import RunReporter
    from app.engine.runs.rundir import RunDir
    from app.engine.training.preference import PreferenceConfig, train_preference

    sample = Path(__file__).resolve().parents[1] / "sample_data"
    config = PreferenceConfig(model=str(sample / "tiny-moe.gguf"),
                              data=str(sample / "preferences.jsonl"), val_split=0.1,
                              max_steps=40, epochs=0, eval_every=5)
    run = RunDir.create(ctx.runs_root() / "dpo-preferences", config.to_dict())
    reporter = RunReporter(run)
    reporter.started()
    train_preference(config, reporter.report, lambda: None, run.checkpoints_dir)
    reporter.finished("done")
    ctx.select_run(run.path)
    window.show_screen("monitor")
    pump(1.5)                                   # the run's events reach the screen
    shoot("monitor-dpo", 0.8)


def parse_size(text: str) -> tuple[int, int]:
    width, _, height = text.lower().partition("x")
    return int(width), int(height)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="folder for the PNG files")
    parser.add_argument("--epochs", type=int, default=1, help="epochs of the sample run")
    parser.add_argument("--size", type=parse_size, action="append", metavar="WxH",
                        help="window size, repeatable; the first names the files plainly "
                             "(default: 1280x800 and 1920x1080)")
    parser.add_argument("--quick", action="store_true",
                        help="only the screens that need no run: New run, Settings > Clusters")
    args = parser.parse_args(argv)
    sizes = args.size or list(SIZES)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    from PySide6.QtCore import QDeadlineTimer, QSettings, QThread

    from app.views.app import build_window, prepare_app

    app = prepare_app([sys.argv[0]])

    def pump(seconds: float = 0.3) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            app.processEvents()
            QThread.msleep(10)

    def wait(done, what: str, timeout_s: float = 120) -> None:
        deadline = QDeadlineTimer(int(timeout_s * 1000))
        while not done():
            if deadline.hasExpired():
                raise TimeoutError(f"timed out waiting for {what}")
            app.processEvents()
            QThread.msleep(20)

    def shoot(name: str, settle: float = 0.4) -> None:
        for i, size in enumerate(sizes):
            window.resize(*size)
            pump(settle)
            path = out / (f"{name}.png" if i == 0 else f"{name}-{size[0]}.png")
            window.grab().save(str(path))
            print(f"wrote {path}")
        window.resize(*sizes[0])

    def shoot_dark(name: str) -> None:
        """`name` in the dark theme (widgets/theme.py), then the theme it had again."""
        from app.views.widgets import theme

        mode = theme.current().mode
        theme.apply_theme(app, mode="dark")
        try:
            shoot(name, 0.8)
        finally:
            theme.apply_theme(app, mode=mode)

    with tempfile.TemporaryDirectory(prefix="workbench-shots-") as tmp:
        # the user's state (list of runs, trusted rewards) lives beside the queue: keep it private
        os.environ["WORKBENCH_QUEUE"] = os.path.join(tmp, "queue.sqlite3")
        settings = QSettings(os.path.join(tmp, "settings.ini"), QSettings.IniFormat)
        window = build_window(settings, os.path.join(tmp, "queue.sqlite3"),
                              os.path.join(tmp, "runs"))
        ctx = window.ctx
        window.resize(*sizes[0])
        window.show()
        new_run = window.new_run
        wait(lambda: new_run.card is not None and new_run.dataset.report is not None
             and not new_run.dataset.is_busy() and new_run.memory_estimate is not None,
             "the sample model and dataset")
        try:
            for i, name in enumerate(("new-run-model", "new-run-dataset", "new-run-training")):
                new_run.tabs.setCurrentIndex(i)
                shoot(name)

            add_example_clusters(ctx, os.path.join(tmp, "runs"))
            window.show_screen("settings")
            window.screen("settings").clusters.select(CLUSTER)
            shoot("settings-clusters")
            window.show_screen("new_run")
            new_run.tabs.setCurrentIndex(0)
            new_run.run_on.set_executor(CLUSTER)
            new_run.name_field.setText("moe-on-the-lab")
            shoot("new-run-run-on")
            new_run.run_on.set_executor("local")        # the runs below run here
            new_run.tabs.setCurrentIndex(1)
            shoot_dark("new-run-dataset-dark")
            shoot_new_run_dpo(new_run, wait, shoot)
            new_run.tabs.setCurrentIndex(0)
            shoot_get_model(new_run, out, wait, pump)
            if args.quick:
                return 0

            form = new_run.form
            form["epochs"].setValue(args.epochs)
            form["eval_every"].setValue(10)
            form["save_every"].setValue(20)
            form["norms_every"].setValue(4)
            new_run.name_field.setText("first-run")
            run = new_run.create_run(start=True)
            wait(lambda: ctx.current_run == run, "the run to be queued", 30)
            wait(ctx.worker_running, "the worker to start", 30)
            monitor = window.screen("monitor")
            curve = monitor.loss_curve
            wait(lambda: curve.xData is not None and len(curve.xData) >= 8, "the first steps")
            shoot("monitor-live")
            runs = window.screen("runs")
            wait(lambda: any(r.path == run and r.state == "done" for r in runs.rows),
                 "the run to finish", 600)
            pump(1.5)                                   # the last events reach the screens
            for key in ("monitor", "experts"):
                window.show_screen(key)
                shoot(key, 0.8)
            window.show_screen("monitor")
            shoot_dark("monitor-dark")

            window.show_screen("export")
            export = window.screen("export")
            export.set_format("gguf-lora", "f16")
            export.llamacpp_box.setChecked(False)
            export.start_export()
            wait(lambda: not export.is_busy(), "the export")
            shoot("export")

            window.show_screen("playground")
            play = window.screen("playground")
            play.max_tokens.setValue(40)
            for message in ("Tell me a story about Ben.", "And what did Ben do next?"):
                play.message.setPlainText(message)
                play.send()
                wait(lambda: not play.is_generating(), "the answer")
            shoot("playground")

            window.show_screen("evaluate")      # the first run's adapter on the sample sets
            evaluate = window.screen("evaluate")
            evaluate.refresh_runs()
            evaluate.tick("first-run")
            evaluate.evaluate()
            wait(lambda: evaluate.evaluate_button.isEnabled(), "the evaluation", 300)
            shoot("evaluate", 0.8)

            window.show_screen("new_run")
            new_run.grpo_panel.demo_button.click()
            for i, name in ((1, "new-run-grpo"), (2, "new-run-grpo-training")):
                new_run.tabs.setCurrentIndex(i)
                shoot(name)
            new_run.name_field.setText("grpo-addition")
            grpo_run = new_run.create_run(start=True)
            wait(lambda: ctx.current_run == grpo_run, "the GRPO run to be queued", 30)
            wait(lambda: any(r.path == grpo_run and r.state == "done" for r in runs.rows),
                 "the GRPO run to finish", 900)
            pump(1.5)
            window.show_screen("monitor")
            monitor.pages.setCurrentWidget(monitor.grpo)
            shoot("monitor-grpo", 0.8)
            monitor.pages.setCurrentWidget(monitor.completions)
            table = monitor.completions          # the newest sampled step whose rewards differ
            table.select(max(step for step, source, items in table.entries
                             if source == "sampled" and any(it["advantage"] for it in items)))
            items = table.current_entry()[2]                         # a rewarded completion
            table.table.selectRow(next(r for r, it in enumerate(items) if it["advantage"] > 0))
            shoot("completions", 0.8)
            shoot_preference_run(ctx, window, pump, shoot)
            window.show_screen("runs")
            shoot("runs", 0.8)

            window.show_screen("new_run")
            new_run.set_run_type("sft")
            new_run.tabs.setCurrentIndex(0)
            bad = Path(tmp) / "broken-download.gguf"
            bad.write_bytes(b"GGUF" + os.urandom(200))
            new_run.open_model(str(bad))
            wait(new_run.model_error_shown, "the error panel")
            new_run.model_error.details_button.setChecked(True)
            shoot("error")
        finally:
            ctx.stop_worker()
            window.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
