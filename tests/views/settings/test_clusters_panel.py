"""Settings > Clusters: add, edit and remove clusters (kept in the queue's clusters.json, tokens
in a keyring), a private token file without a keyring, and "Test connection" off the GUI thread."""

from __future__ import annotations

import os
import threading

import pytest

import app.views.settings.clusters_panel as clusters_panel
from app.engine.api import ClusterError
from app.views.settings.clusters_panel import KEEP_TOKEN, ClustersPanel
from tests.views.conftest import shown, untipped_inputs

SERVICE = "gguf-workbench"


@pytest.fixture(autouse=True)
def no_token_env(monkeypatch):
    for name in ("LAB", "HOME_HEAD"):
        monkeypatch.delenv(f"WORKBENCH_CLUSTER_TOKEN_{name}", raising=False)


@pytest.fixture
def panel(qtbot, ctx):
    return shown(qtbot, ClustersPanel(ctx), 1000, 600)


def fill(panel, **values):
    for key, value in values.items():
        field = panel.form[key]
        if hasattr(field, "setText"):
            field.setText(value)
        else:
            field.setValue(value)


def save(qtbot, panel):
    panel.save_button.click()
    qtbot.waitUntil(lambda: not panel.busy(), timeout=5000)


def test_add_edit_and_remove_a_cluster(qtbot, ctx, panel, memory_keyring):
    assert panel.names() == [] and panel.current is None
    assert untipped_inputs(panel) == []
    fill(panel, name="lab", url="http://head:8265/", token="s3cret",
         path_map="/home/me/runs=/mnt/shared/runs", python="/opt/wb/bin/python", num_gpus=1.0)
    with qtbot.waitSignal(ctx.clusters_changed, timeout=5000):
        panel.save_button.click()
    qtbot.waitUntil(lambda: not panel.busy())
    assert panel.names() == ["lab"] and panel.current == "lab"
    cluster = ctx.clusters().get("lab")
    assert (cluster.url, str(cluster.path_map), cluster.python, cluster.num_cpus,
            cluster.num_gpus) == ("http://head:8265", "/home/me/runs=/mnt/shared/runs",
                                  "/opt/wb/bin/python", 1.0, 1.0)
    assert memory_keyring.passwords == {(SERVICE, "cluster:lab"): "s3cret"}
    assert panel.form["token"].text() == ""                  # never shown again
    assert panel.form["token"].placeholderText() == KEEP_TOKEN
    assert panel.form["name"].isReadOnly()

    fill(panel, url="http://head2:8265", num_cpus=4.0)       # edit; the token stays
    save(qtbot, panel)
    assert ctx.clusters().get("lab").url == "http://head2:8265"
    assert ctx.clusters().get("lab").num_cpus == 4.0
    assert memory_keyring.passwords == {(SERVICE, "cluster:lab"): "s3cret"}

    again = shown(qtbot, ClustersPanel(ctx))                 # a new window reads them back
    assert again.names() == ["lab"]
    assert again.form["url"].text() == "http://head2:8265"
    assert again.form["path_map"].text() == "/home/me/runs=/mnt/shared/runs"
    assert again.form["num_gpus"].value() == 1.0

    panel.add_button.click()                                 # a second one
    assert panel.current is None and panel.form["name"].text() == ""
    assert not panel.remove_button.isEnabled()
    fill(panel, name="lab", url="http://other:8265")         # the name is taken
    save(qtbot, panel)
    assert "There is a cluster named lab already" in panel.form.errors()["name"]
    fill(panel, name="home-head", url="http://127.0.0.1:8265")
    save(qtbot, panel)
    assert panel.names() == ["home-head", "lab"] and panel.current == "home-head"

    panel.select("lab")
    with qtbot.waitSignal(ctx.clusters_changed, timeout=5000):
        panel.remove_button.click()
    qtbot.waitUntil(lambda: not panel.busy())
    assert panel.names() == ["home-head"] and ctx.clusters().names() == ["home-head"]
    assert memory_keyring.passwords == {}                    # its token went with it


def test_invalid_fields_are_shown_under_them_and_nothing_is_saved(qtbot, ctx, panel,
                                                                   memory_keyring):
    fill(panel, name="my lab!", url="head:8265", path_map="runs=/mnt/runs")
    save(qtbot, panel)
    errors = panel.form.errors()
    assert set(errors) == {"name", "url", "path_map"}
    assert "not usable" in errors["name"] and "http" in errors["url"]
    assert "absolute" in errors["path_map"]
    assert ctx.clusters().names() == []
    panel.form["url"].setText("http://head:8265")            # an edit clears its problem
    assert set(panel.form.errors()) == {"name", "path_map"}


def test_without_a_keyring_the_token_is_kept_in_a_private_file_and_the_panel_says_so(
        qtbot, ctx, panel, no_keyring):
    """Issue 29 item 10: without an OS keyring the token could not be saved at all ("No
    recommended backend was available"), the way out an environment variable and a restart."""
    fill(panel, name="lab", url="http://head:8265", token="s3cret")
    save(qtbot, panel)
    assert not panel.error_panel.isVisible()
    assert ctx.clusters().names() == ["lab"]
    store = ctx.clusters()
    assert store.token("lab") == "s3cret"
    assert os.stat(store.token_file).st_mode & 0o777 == 0o600
    assert panel.token_warning.isVisible()
    assert "No OS keyring" in panel.token_warning.text()
    assert store.token_file in panel.token_warning.text()
    panel.remove_button.click()
    qtbot.waitUntil(lambda: not panel.busy(), timeout=5000)
    assert ctx.clusters().names() == []
    assert store.token("lab") is None                        # its token went with it


def test_test_connection_runs_off_the_gui_thread_and_shows_the_answer(qtbot, ctx, panel,
                                                                      memory_keyring,
                                                                      monkeypatch):
    """Issue 29 item 2: Test connection asked the dashboard only; it gives what `workbench
    cluster test` gives (api.cluster_test, faked here at the api boundary): reachable with its
    Ray version, then whether a job there runs this workbench, each answer as it comes."""
    calls, probe_may_end = [], threading.Event()

    def answers(cluster, token):
        calls.append((cluster.url, token, threading.current_thread() is threading.main_thread()))
        yield "Connected", "Ray 2.60.0, 4 CPUs, 0 GPUs"
        assert probe_may_end.wait(10)
        calls.append(threading.current_thread() is threading.main_thread())
        yield "Runs a job", "workbench 0.1.0 (as here) at /opt/wb/bin/python; no path map"

    monkeypatch.setattr(clusters_panel, "cluster_test", answers)
    fill(panel, name="lab", url="http://head:8265", token="typed")
    panel.test_button.click()                                # not saved: the form as typed
    qtbot.waitUntil(lambda: "Connected" in panel.test_label.text(), timeout=5000)
    assert panel.test_label.text() == ("\u2714 Connected: Ray 2.60.0, 4 CPUs, 0 GPUs\n"
                                       "Running a test job on the cluster\u2026")
    assert not panel.test_button.isEnabled() and panel.test_label.property("ok") is None
    probe_may_end.set()
    qtbot.waitUntil(lambda: panel.test_label.property("ok") is True, timeout=5000)
    assert panel.test_label.text() == (
        "\u2714 Connected: Ray 2.60.0, 4 CPUs, 0 GPUs\n"
        "\u2714 Runs a job: workbench 0.1.0 (as here) at /opt/wb/bin/python; no path map")
    assert calls == [("http://head:8265", "typed", False), False]
    assert panel.test_button.isEnabled() and not panel.error_panel.isVisible()

    def no_job(cluster, token):
        yield "Connected", "Ray 2.60.0, 4 CPUs, 0 GPUs"
        raise ClusterError("Cluster 'lab' runs workbench 0.0.9 (/usr/bin/python); this machine "
                           "runs 0.1.0.", "Install the same version on both.")

    monkeypatch.setattr(clusters_panel, "cluster_test", no_job)
    panel.test_button.click()
    qtbot.waitUntil(lambda: panel.test_label.property("ok") is False, timeout=5000)
    assert panel.test_label.text() == ("\u2714 Connected: Ray 2.60.0, 4 CPUs, 0 GPUs\n"
                                       "\u2716 Cannot run a job")
    assert panel.error_panel.title_label.text() == "Test connection failed"
    assert "runs workbench 0.0.9" in panel.error_panel.message_label.text()

    memory_keyring.set_password(SERVICE, "cluster:lab", "stored")
    fill(panel, token="")                                    # empty: the stored token

    def refuse(cluster, token):
        calls.append((cluster.url, token, False))
        raise ClusterError("http://head:8265 refused the token (HTTP 401).",
                           "Check the cluster's token in Settings > Clusters.")
        yield                                                # a generator, as cluster_test

    monkeypatch.setattr(clusters_panel, "cluster_test", refuse)
    panel.test_button.click()
    qtbot.waitUntil(panel.error_panel.isVisible, timeout=5000)
    assert calls[-1] == ("http://head:8265", "stored", False)
    assert panel.test_label.text() == "\u2716 Not connected"
    assert panel.error_panel.title_label.text() == "Test connection failed"
    assert panel.error_panel.message_label.text() == \
        "http://head:8265 refused the token (HTTP 401)."
    assert panel.error_panel.hint_label.text() == \
        "Check the cluster's token in Settings > Clusters."


def test_test_connection_to_an_address_where_nothing_listens(qtbot, ctx, panel,
                                                             memory_keyring):
    """The real engine call (no fake): a port on this machine that nobody listens on."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                            # free once closed
    fill(panel, name="lab", url=f"http://127.0.0.1:{port}", token="t")
    panel.test_button.click()
    qtbot.waitUntil(lambda: panel.test_label.property("ok") is False, timeout=30_000)
    assert panel.test_label.text() == "\u2716 Not connected"
    assert panel.error_panel.isVisible()
    assert f"127.0.0.1:{port}" in panel.error_panel.message_label.text()


@pytest.mark.slow
def test_test_connection_against_a_real_loopback_head(qtbot, ctx, panel, memory_keyring,
                                                      ray_head):
    """What `workbench cluster test` says, in the panel: reachable, Ray's version, and a job
    that ran there with the cluster's Python and imported this workbench."""
    import sys

    import app
    fill(panel, name="lab", url=ray_head.dashboard_url, token=ray_head.token,
         python=sys.executable)
    panel.test_button.click()
    qtbot.waitUntil(lambda: panel.test_label.property("ok") is not None, timeout=150_000)
    connected, job = panel.test_label.text().split("\n")
    assert connected.startswith("\u2714 Connected: Ray 2."), \
        panel.error_panel.message_label.text()
    assert "CPUs" in connected
    assert job == (f"\u2714 Runs a job: workbench {app.__version__} (as here) at "
                   f"{sys.executable}; no path map (a head on this machine sees its paths)")
    fill(panel, token="wrong-token")
    panel.test_button.click()
    qtbot.waitUntil(lambda: panel.test_label.property("ok") is False, timeout=30_000)
    assert panel.error_panel.isVisible()
    assert "token" in (panel.error_panel.message_label.text() +
                       panel.error_panel.hint_label.text()).lower()
