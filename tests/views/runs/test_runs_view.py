"""RunsView: every job and run folder, live progress, actions on the queue, stored errors."""

from __future__ import annotations

import json
import shutil

import pytest
from PySide6.QtCore import Qt

from app.views.runs.table import PROGRESS_ROLE
from app.views.runs.view import COL, RunsView, error_from_dict
from tests.views.fake_runs import FakeGrpoRun, FakeRun, fake_config

ERROR = {"kind": "training_diverged",
         "message": "The loss or gradients were NaN/Inf for 5 steps in a row (step 37).",
         "hint": "Lower the learning rate, set gclip (e.g. 1.0), or check the data.",
         "detail": "Traceback (most recent call last):\n  TrainingDiverged: boom"}


def make(ctx, name, steps=0, **kw) -> FakeRun:
    fake = FakeRun(ctx.runs_root() / name, total_steps=100, **kw)
    fake.step(steps)
    return fake


def refreshed(qtbot, view: RunsView) -> RunsView:
    """`view` registered with qtbot and showing the runs as they are now."""
    qtbot.addWidget(view)
    view.refresh()
    return view


@pytest.fixture
def runs(ctx, qtbot):
    """done, failed, running, queued, paused jobs and one run from the terminal."""
    q = ctx.queue
    out = {}
    out["done"] = make(ctx, "done", 100)
    q.add(out["done"].path)
    q.finish(q.claim_next("w").id, "w", "done")
    out["done"].finish()
    out["failed"] = make(ctx, "failed", 37)
    q.add(out["failed"].path)
    q.finish(q.claim_next("w").id, "w", "failed", ERROR)
    out["failed"].finish("failed", {k: ERROR[k] for k in ("kind", "message", "hint")})
    out["running"] = make(ctx, "running", 42)
    q.add(out["running"].path)
    q.claim_next("w")
    out["queued1"] = make(ctx, "queued1")
    q.add(out["queued1"].path)
    out["queued2"] = make(ctx, "queued2")
    q.add(out["queued2"].path)
    out["paused"] = make(ctx, "paused", 12)
    q.pause(q.add(out["paused"].path))
    out["terminal"] = make(ctx, "terminal", 80)
    return out


def row(view, name):
    return next(r for r in view.rows if r.name == name)


def pending_order(ctx):
    return [j.run_dir.rsplit("/", 1)[-1] for j in ctx.queue.list(("queued", "paused"))]


def test_every_job_and_terminal_run_is_listed(qtbot, ctx, runs):
    view = refreshed(qtbot, RunsView(ctx))
    names = [r.name for r in view.rows]
    assert names[:4] == ["running", "queued1", "queued2", "paused"]          # queue order
    assert set(names) == {"done", "failed", "running", "queued1", "queued2", "paused",
                          "terminal"}
    assert {r.name: r.state for r in view.rows} == {
        "done": "done", "failed": "failed", "running": "running", "queued1": "queued",
        "queued2": "queued", "paused": "paused", "terminal": "running"}
    assert row(view, "terminal").job is None                   # started from the CLI
    i = names.index("running")
    job = row(view, "running").job.id
    assert view.text(i, "Status") == "running \u00b7 ETA 0:00:06"
    assert view.model.index(i, COL["Status"]).data(Qt.ToolTipRole) == \
        f"running \u00b7 ETA 0:00:06 (job {job} in the queue)"
    assert view.text(i, "Steps") == "42/100"
    assert view.model.index(i, COL["Steps"]).data(PROGRESS_ROLE) == (42, 100, False)
    assert view.text(i, "Best") == f"{FakeRun.loss_at(42):.3f} latest"
    assert view.text(i, "Model") == "tiny-moe.gguf"
    assert view.text(i, "Created")[:2] == "20"                  # a date
    assert view.text(names.index("terminal"), "Status").startswith("running")
    assert "outside the queue" in view.model.index(names.index("terminal"),
                                                   COL["Status"]).data(Qt.ToolTipRole)
    assert view.model.index(names.index("done"), COL["Steps"]).data(PROGRESS_ROLE)[2]


def test_a_job_handed_to_a_cluster_reads_submitting_as_in_queue_list(qtbot, ctx, capsys):
    """Issue 29 item 6: a cluster job the cluster has not accepted yet (status.json: submitting;
    the queue's row: running) was 'running' in the window, 'submitting' in `workbench queue
    list`: one engine function (api.job_state) says it for both."""
    from app.cli.main import run_cli
    from app.engine.api import job_state
    fake = make(ctx, "on-lab")
    ctx.queue.add(fake.path)
    job = ctx.queue.claim_next("w")
    fake.run.write_status(state="submitting")
    assert job.state == "running" and job_state(job, fake.run.status()) == "submitting"
    view = refreshed(qtbot, RunsView(ctx))
    assert view.text(0, "Status") == "submitting" and view.summary.text() == "1 submitting"
    assert run_cli(["queue", "list", "--queue", str(ctx.queue.path)]) == 0
    [line] = [x for x in capsys.readouterr().out.splitlines() if "on-lab" in x]
    assert line.split()[1] == "submitting"
    fake.run.write_status(state="running")                     # the cluster took it
    view = refreshed(qtbot, RunsView(ctx))
    assert view.text(0, "Status").startswith("running")


def test_a_grpo_run_shows_its_type_and_latest_reward(qtbot, ctx, runs):
    grpo = FakeGrpoRun(ctx.runs_root() / "grpo", total_steps=20)
    grpo.step(6)
    grpo.samples()                                 # newer events than the last step
    grpo.eval(0.9)
    view = refreshed(qtbot, RunsView(ctx))
    names = [r.name for r in view.rows]
    i = names.index("grpo")
    assert view.text(i, "Type") == "GRPO"
    assert view.text(i, "Best") == "0.900 @ 6"
    j = names.index("done")
    assert view.text(j, "Type") == "SFT"
    grpo.step(1)
    grpo.eval(0.95)
    view.refresh()
    i = [r.name for r in view.rows].index("grpo")
    assert view.text(i, "Best") == "0.950 @ 7"


def test_progress_follows_a_run_being_written(qtbot, ctx):
    fake = make(ctx, "live", 5)
    view = RunsView(ctx)
    qtbot.addWidget(view)
    qtbot.waitUntil(lambda: bool(view.rows) and view.rows[0].step == 5)
    writer = fake.play_in_thread(60, delay_s=0.002)
    qtbot.waitUntil(lambda: view.rows[0].step == 65, timeout=10000)
    writer.join()
    assert view.text(0, "Steps") == "65/100"


def test_selecting_a_failed_run_selects_it_and_shows_its_error(qtbot, ctx, runs):
    view = refreshed(qtbot, RunsView(ctx))
    with qtbot.waitSignal(ctx.run_selected) as sig:
        view.select(runs["failed"].path)
    assert sig.args == [runs["failed"].path]
    assert ctx.current_run == runs["failed"].path
    panel = view.error_panel
    assert not panel.isHidden()
    assert panel.title_label.text() == "failed failed"
    assert panel.message_label.text() == ERROR["message"]
    assert panel.hint_label.text() == ERROR["hint"]
    details = panel.details_view.toPlainText()
    assert "TrainingDiverged: boom" in details and "training_diverged" in details
    view.select(runs["done"].path)
    assert panel.isHidden()


def test_a_run_selected_elsewhere_is_selected_here(qtbot, ctx, runs):
    view = refreshed(qtbot, RunsView(ctx))
    ctx.select_run(runs["paused"].path)          # e.g. from the New run screen
    assert view.selected_row().name == "paused"
    assert view.table.selectionModel().selectedRows()[0].row() == \
        [r.name for r in view.rows].index("paused")
    assert view.buttons["continue"].isEnabled() and not view.buttons["pause"].isEnabled()
    late = make(ctx, "late")
    ctx.select_run(late.path)                    # not listed yet: selected when it appears
    view.refresh()
    assert view.selected_row().name == "late"


def test_a_terminal_run_error_comes_from_its_status(qtbot, ctx):
    fake = make(ctx, "cli-failed", 3)
    fake.run.write_status(state="failed", error={"kind": "dataset", "message": "Bad row 3.",
                                                 "hint": "Fix line 3."})
    view = refreshed(qtbot, RunsView(ctx))
    view.select(fake.path)
    assert view.error_panel.message_label.text() == "Bad row 3."
    assert view.error_panel.hint_label.text() == "Fix line 3."


def test_reorder_cancel_pause_resume(qtbot, ctx, runs):
    view = refreshed(qtbot, RunsView(ctx))
    assert pending_order(ctx) == ["queued1", "queued2", "paused"]
    view.select(runs["queued2"].path)
    assert view.buttons["up"].isEnabled() and not view.buttons["continue"].isEnabled()
    view.move_up()
    assert pending_order(ctx) == ["queued2", "queued1", "paused"]
    assert [r.name for r in view.rows][:4] == ["running", "queued2", "queued1", "paused"]
    view.move_down()
    view.move_down()
    assert pending_order(ctx) == ["queued1", "paused", "queued2"]

    view.select(runs["queued1"].path)
    view.cancel()
    assert row(view, "queued1").state == "cancelled"

    view.select(runs["paused"].path)
    assert view.buttons["continue"].isEnabled() and not view.buttons["pause"].isEnabled()
    view.continue_run()
    assert row(view, "paused").state == "queued"
    assert ctx.worker_starts
    assert view.buttons["pause"].isEnabled() and not view.buttons["continue"].isEnabled()
    view.pause()
    assert row(view, "paused").state == "paused"

    view.select(runs["running"].path)
    view.pause()                                 # running: the worker pauses after its step
    assert row(view, "running").job.requested_action == "pause"
    assert view.text(0, "Status").startswith("running (pausing\u2026)")
    assert view.buttons["continue"].isEnabled()  # takes the pause request back
    view.cancel()                                # cancelling overrides the pause request
    assert view.text(0, "Status").startswith("running (cancelling…)")
    assert not view.buttons["cancel"].isEnabled() and not view.buttons["up"].isEnabled()
    view.move_up()                               # forced anyway: refused, shown, not raised
    assert not view.error_panel.isHidden()
    assert view.error_panel.title_label.text() == "Could not move running"
    assert "only queued or paused jobs" in view.error_panel.message_label.text()


def test_retry_a_failed_job(qtbot, ctx, runs):
    view = refreshed(qtbot, RunsView(ctx))
    view.select(runs["failed"].path)
    assert view.buttons["continue"].isEnabled()
    with qtbot.waitSignal(ctx.runs_changed):
        view.continue_run()
    assert row(view, "failed").state == "queued"
    assert row(view, "failed").job.error is None
    assert ctx.worker_starts == [1]


def test_extend_a_finished_run_by_epochs(qtbot, ctx, runs):
    view = refreshed(qtbot, RunsView(ctx))
    view.select(runs["done"].path)
    assert view.buttons["extend"].isEnabled()
    view.extend_epochs.setValue(3)
    view.extend()
    cfg = json.loads((runs["done"].run.config_path).read_text())
    assert cfg["epochs"] == 5                                  # 2 + 3
    jobs = ctx.queue.find(runs["done"].path)
    assert [j.state for j in jobs] == ["queued", "done"]       # a new job, the old one kept
    assert row(view, "done").state == "queued"
    assert ctx.worker_starts == [1]


def test_extend_refuses_a_run_that_counts_steps(qtbot, ctx):
    fake = FakeRun(ctx.runs_root() / "steps", config=fake_config(epochs=0, max_steps=50))
    fake.finish()
    view = refreshed(qtbot, RunsView(ctx))
    view.select(fake.path)
    assert not view.buttons["extend"].isEnabled()
    view.extend(2)                                             # forced: refused, explained
    assert not view.error_panel.isHidden()
    assert "count epochs" in view.error_panel.message_label.text()
    assert json.loads(fake.run.config_path.read_text())["epochs"] == 0
    assert ctx.queue.list() == []


def test_resume_a_terminal_run_from_its_checkpoint(qtbot, ctx):
    fake = make(ctx, "interrupted", 30)
    fake.run.write_status(state="paused")
    (fake.run.checkpoints_dir / "step-30").mkdir()
    view = refreshed(qtbot, RunsView(ctx))
    view.select(fake.path)
    assert view.buttons["continue"].isEnabled()
    view.continue_run()
    jobs = ctx.queue.find(fake.path)
    assert [j.state for j in jobs] == ["queued"]
    assert row(view, "interrupted").job.id == jobs[0].id
    assert ctx.worker_starts == [1]


def test_open_folder(qtbot, ctx, runs):
    view = RunsView(ctx)
    qtbot.addWidget(view)
    opened = []
    view.open_url = opened.append
    view.refresh()
    view.select(runs["done"].path)
    view.open_folder()
    assert [u.toLocalFile() for u in opened] == [runs["done"].path]


def test_error_from_dict():
    e = error_from_dict({"kind": "bug", "message": "KeyError: 'x'", "hint": None})
    assert e.kind == "bug" and e.message == "KeyError: 'x'" and "bug" in e.hint


def test_registered_runs_are_listed_wherever_their_folder_is(qtbot, ctx, tmp_path):
    from app.engine.runs.rundir import RunDir

    RunDir.create(tmp_path / "elsewhere" / "cli-run", fake_config())      # as the CLI does
    gone = RunDir.create(tmp_path / "elsewhere" / "deleted", fake_config())
    shutil.rmtree(gone.path)
    view = refreshed(qtbot, RunsView(ctx))
    states = {r.name: r.state for r in view.rows}
    assert states == {"cli-run": "new", "deleted": "missing"}
    i = [r.name for r in view.rows].index("deleted")
    assert view.text(i, "Status") == "missing"
    assert view.text(i, "Model") == ""


def test_the_best_evaluation_and_its_step(qtbot, ctx):
    fake = make(ctx, "evaluated", 30)
    fake.eval()                                            # best at step 30
    fake.step(10)
    view = refreshed(qtbot, RunsView(ctx))
    loss = FakeRun.loss_at(30) + 0.1
    assert view.text(0, "Best") == f"{loss:.3f} @ 30"
    assert view.model.index(0, COL["Best"]).data(Qt.ToolTipRole) == \
        f"Best validation {loss:.4f} at step 30"
    assert view.text(0, "Dataset")


def test_where_each_run_runs_and_its_attempt(qtbot, ctx):
    from app.engine.api import Cluster

    ctx.clusters().save(Cluster("lab", "http://127.0.0.1:8265"))   # a head here: any folder
    q = ctx.queue
    local = make(ctx, "local", 5)
    q.add(local.path)
    sent = make(ctx, "sent", 3)
    job = q.add(sent.path, executor="lab")
    make(ctx, "terminal", 2)
    view = refreshed(qtbot, RunsView(ctx))

    def where(name):
        i = [r.name for r in view.rows].index(name)
        return view.text(i, "Where"), view.model.index(i, COL["Where"]).data(Qt.ToolTipRole)

    assert view.model.headerData(COL["Where"], Qt.Horizontal) == "Where"
    assert where("local")[0] == "this computer"
    assert where("sent") == ("lab", f"Job {job} runs on cluster lab")
    assert where("terminal") == ("this computer",
                                 "Run here, outside the queue (the command line)")
    q.pause(q.add(make(ctx, "waiting").path))
    claimed = q.claim_next("w")                                     # the local job first
    assert claimed.run_dir == local.path
    q.finish(claimed.id, "w", "done")
    assert q.claim_next("w").id == job
    q.record_attempt(job, "w", 1, {"submission_id": f"wb-{job}-a1", "cluster": "lab"})
    view.refresh()
    assert where("sent") == ("lab", f"Job {job} runs on cluster lab, attempt 1 "
                                    f"(Ray submission wb-{job}-a1)")
    q.record_attempt(job, "w", 2, {"submission_id": f"wb-{job}-a2", "cluster": "lab"})
    view.refresh()                                 # the cluster lost the first attempt
    assert where("sent") == ("lab \u00b7 attempt 2", f"Job {job} runs on cluster lab, "
                                                     f"attempt 2 (Ray submission wb-{job}-a2)")
    assert where("local") == ("this computer", f"Job {claimed.id} runs on this computer, "
                                                "attempt 1")
