"""New run's "Run on": this computer or a cluster; why there is no cluster; a run folder the
cluster's path map does not cover is refused before anything is queued."""

from __future__ import annotations

import os

from app.engine.api import Cluster, PathMap
from app.views.new_run.run_on import NO_CLUSTER, THIS_COMPUTER


def items(view) -> list[str]:
    combo = view.run_on.combo
    return [combo.itemText(i) for i in range(combo.count())]


def add_cluster(ctx, name, url="http://head:8265", path_map=""):
    ctx.clusters().save(Cluster(name, url, PathMap.parse(path_map)))
    ctx.clusters_changed.emit()                   # what Settings > Clusters does after a save


def test_without_a_cluster_the_choice_says_why(qtbot, new_run, ctx):
    view = new_run
    assert items(view) == [THIS_COMPUTER, NO_CLUSTER]
    assert NO_CLUSTER == "No cluster: add one in Settings > Clusters"
    item = view.run_on.combo.model().item(1)
    assert not item.isEnabled() and item.toolTip() == NO_CLUSTER
    assert view.run_on.combo.toolTip().startswith(NO_CLUSTER)
    assert view.run_on.executor() == "local" and view.run_on.cluster() is None
    with qtbot.waitSignal(view.run_created, timeout=10_000):
        path = view.create_run(start=False)
    assert [(j.run_dir, j.executor) for j in ctx.queue.list("queued")] == [(path, "local")]


def test_the_chosen_cluster_is_passed_to_the_queue(qtbot, new_run, ctx):
    view = new_run
    add_cluster(ctx, "lab", path_map=f"{ctx.runs_root()}=/mnt/shared/runs")
    add_cluster(ctx, "big", path_map="/mnt/x=/mnt/x")
    assert items(view) == [THIS_COMPUTER, "big", "lab"]
    assert view.run_on.combo.itemData(2, 3) == "http://head:8265"     # Qt.ToolTipRole
    view.run_on.set_executor("lab")
    assert view.problems() == []
    assert "on lab" in view.summary_label.text()
    with qtbot.waitSignal(view.run_created, timeout=10_000):
        path = view.create_run(start=False)
    jobs = ctx.queue.list("queued")
    assert [(j.run_dir, j.executor) for j in jobs] == [(path, "lab")]
    assert view.run_on.executor() == "lab"                # the choice stays for the next run

    ctx.clusters().remove("lab")                         # removed in Settings
    ctx.clusters_changed.emit()
    assert items(view) == [THIS_COMPUTER, "big"] and view.run_on.executor() == "local"


def test_a_folder_the_path_map_does_not_cover_is_refused_before_queueing(qtbot, new_run,
                                                                           ctx):
    view = new_run
    add_cluster(ctx, "far", path_map="/mnt/elsewhere=/data/runs")
    view.run_on.set_executor("far")
    view.name_field.setText("sent-far")
    problems = [m for _, m in view.problems()]
    assert len(problems) == 1 and problems[0].startswith("far cannot see the run folder: ")
    assert str(ctx.runs_root() / "sent-far") in problems[0]
    assert "Settings > Clusters" in problems[0]                      # the engine's hint
    assert problems[0] in view.problems_label.text()
    assert not view.queue_button.isEnabled() and not view.start_button.isEnabled()
    assert view.create_run(start=False) is None
    assert ctx.queue.list() == [] and not os.path.exists(ctx.runs_root() / "sent-far")

    view.run_on.set_executor("local")                     # this computer sees every folder
    assert view.problems() == [] and view.queue_button.isEnabled()


def test_a_head_on_this_machine_sees_local_paths(qtbot, new_run, ctx):
    view = new_run
    add_cluster(ctx, "home", url="http://127.0.0.1:8265")
    view.run_on.set_executor("home")
    assert view.problems() == []
    with qtbot.waitSignal(view.run_created, timeout=10_000):
        view.create_run(start=True)
    assert [j.executor for j in ctx.queue.list("queued")] == ["home"]
    assert ctx.worker_starts == [1]             # the worker here submits and follows it
