""""Get a model...": search, files with what fits, download with progress and cancel, then the
model opened in the New run screen; against the local Hub (tests/hub_server.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.views.get_model.dialog import GetModelDialog
from tests.hub_server import hub, hub_repos  # noqa: F401  (the fixtures)

LLAMA = "wb-test/tiny-llama-GGUF"
Q8 = "tiny-llama-Q8_0.gguf"


def _cells(table, row):
    return [table.item(row, c).text() for c in range(table.columnCount())]


def _to_files(qtbot, dialog, query="tiny", repo=LLAMA):
    dialog.query.setText(query)
    dialog.search()
    qtbot.waitUntil(lambda: dialog.results.rowCount() > 0, timeout=10_000)
    dialog.select_repo(repo)
    qtbot.waitUntil(lambda: dialog.files.rowCount() > 0 and len(dialog.fits) == len(
        dialog.models), timeout=10_000)


def test_search_files_and_what_fits(qtbot, hub):
    dialog = GetModelDialog()
    qtbot.addWidget(dialog)
    dialog.show()
    _to_files(qtbot, dialog)
    assert _cells(dialog.results, 0)[:3] == [LLAMA, "1,200", "7"]
    assert "(gated)" in _cells(dialog.results, 2)[0]
    rows = [_cells(dialog.files, r) for r in range(dialog.files.rowCount())]
    assert [r[:3] for r in rows] == [[Q8, "Q8_0", "49.0 KB"], ["tiny-llama-F32.gguf", "F32",
                                                               "167.0 KB"]]
    assert all(r[3].startswith("\u2713 llama, needs ") and r[3].endswith(" GB") for r in rows)
    os.makedirs("/tmp/shots", exist_ok=True)
    dialog.select_file(Q8)
    dialog.grab().save("/tmp/shots/get-model.png")


def test_download_with_progress_then_the_picker_opens_it(qtbot, hub, hub_repos, ctx):
    from app.views.new_run.view import NewRunView

    view = NewRunView(ctx, discover=lambda: [])
    qtbot.addWidget(view)
    view.form["rank"].setValue(8)                  # "Trains here?" at the run's settings
    view.picker.get_model()
    dialog = view.picker.get_dialog
    _to_files(qtbot, dialog)
    assert "LoRA rank 8" in dialog.files.item(0, 3).toolTip()
    view.form["rank"].setValue(4)                  # reopened: the same dialog, new estimate
    view.picker.get_model()
    assert view.picker.get_dialog is dialog and dialog.results.rowCount() > 0
    qtbot.waitUntil(lambda: "LoRA rank 4" in dialog.files.item(0, 3).toolTip(), timeout=10_000)
    dialog.select_file(Q8)
    progress = []
    dialog._progress.changed.connect(lambda d, t, n: progress.append(d))
    with qtbot.waitSignal(dialog.downloaded, timeout=20_000) as got:
        dialog.download_button.click()
    path = Path(got.args[0])
    assert path.read_bytes() == hub_repos[LLAMA].files[Q8]
    assert progress and progress[-1] == len(hub_repos[LLAMA].files[Q8])
    qtbot.waitUntil(lambda: view.card is not None and Path(view.card.path) == path,
                    timeout=10_000)


def test_cancel_keeps_the_window_responsive_and_leaves_no_model(qtbot, hub, hub_repos):
    import threading

    hub.hold[Q8] = release = threading.Event()   # 4 KiB, then the rest once cancelled
    dialog = GetModelDialog()
    qtbot.addWidget(dialog)
    dialog.show()
    _to_files(qtbot, dialog)
    dialog.select_file(Q8)
    seen = []
    dialog._progress.changed.connect(lambda d, t, n: seen.append(d))
    dialog.download_button.click()
    assert dialog.is_downloading() and dialog.cancel_button.isEnabled()
    qtbot.waitUntil(lambda: any(seen), timeout=10_000)    # bytes arrive, the window turns
    dialog.cancel_button.click()
    release.set()
    qtbot.waitUntil(lambda: not dialog.is_downloading(), timeout=10_000)
    assert "cancelled" in dialog.status.text() and "kept" in dialog.status.text()
    snapshots = Path(os.environ["HF_HOME"]) / "hub" / "models--wb-test--tiny-llama-GGUF" / \
        "snapshots"
    assert not snapshots.exists() or not any(snapshots.rglob("*.gguf"))
    assert dialog.download_button.isEnabled()


def test_a_closed_dialog_downloads_on_and_the_model_opens(qtbot, hub, hub_repos, ctx):
    from app.views.new_run.view import NewRunView

    hub.slow[Q8] = 0.01
    view = NewRunView(ctx, discover=lambda: [])
    qtbot.addWidget(view)
    view.picker.get_model()
    dialog = view.picker.get_dialog
    _to_files(qtbot, dialog)
    dialog.select_file(Q8)
    dialog.download_button.click()
    dialog.reject()                                # Close
    assert not dialog.isVisible() and dialog.is_downloading()
    qtbot.waitUntil(lambda: view.card is not None and view.card.path.endswith(Q8),
                    timeout=20_000)
    assert Path(view.card.path).read_bytes() == hub_repos[LLAMA].files[Q8]


def test_a_split_model_is_merged_and_opened_as_one_file(qtbot, hub, ctx):
    from app.views.new_run.view import NewRunView

    view = NewRunView(ctx, discover=lambda: [])
    qtbot.addWidget(view)
    view.picker.get_model()
    dialog = view.picker.get_dialog
    _to_files(qtbot, dialog, "mixtral", "wb-test/tiny-mixtral-GGUF")
    dialog.select_file("tiny-mixtral-F32.gguf")
    cell = dialog.files.item(dialog.files.currentRow(), 3)      # estimated before the download
    assert cell.text().startswith("\u2713 llama, needs") and "split into 2 files" in cell.toolTip()
    with qtbot.waitSignal(dialog.downloaded, timeout=20_000) as got:
        dialog.download_button.click()
    assert Path(got.args[0]).name == "tiny-mixtral-F32.gguf"       # the merged file
    qtbot.waitUntil(lambda: view.card is not None and view.card.path == got.args[0],
                    timeout=10_000)
    assert view.card.config.n_expert > 0 and view.card.config.arch == "llama"


def test_offline_says_why_and_what_is_here(qtbot, hub, monkeypatch):
    from app.engine.api import hub as hub_client

    models = hub_client.list_models(LLAMA)
    hub_client.download(next(m for m in models if m.quant == "Q8_0"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dialog = GetModelDialog()
    qtbot.addWidget(dialog)
    dialog.show()
    dialog.search()
    qtbot.waitUntil(dialog.error.isVisible, timeout=10_000)
    assert "HF_HUB_OFFLINE" in dialog.error.message_label.text()
    assert f"{LLAMA}:Q8_0" in dialog.status.text()


def test_no_network_is_said_at_once_and_the_window_stays_responsive(qtbot, tmp_path,
                                                                   monkeypatch):
    from tests.hub_server import closed_port, count_attempts

    attempts = count_attempts(monkeypatch)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    dialog = GetModelDialog()
    qtbot.addWidget(dialog)
    dialog.show()
    dialog.query.setText("tiny")
    dialog.search()                       # returns at once: the search runs in the background
    assert dialog.status.text() == "Searching\u2026"
    qtbot.waitUntil(dialog.error.isVisible, timeout=10_000)
    assert dialog.error.message_label.text().startswith("No network: ")
    assert "refused the connection" in dialog.error.message_label.text()
    assert "no model was downloaded" in dialog.status.text()
    assert len(attempts) == 1, attempts
    os.makedirs("/tmp/shots", exist_ok=True)
    dialog.grab().save("/tmp/shots/get-model-no-network.png")


@pytest.mark.parametrize("fault", ["gated", "server"])
def test_errors_show_in_the_panel(qtbot, hub, fault):
    dialog = GetModelDialog()
    qtbot.addWidget(dialog)
    dialog.show()
    if fault == "server":
        hub.status["/api/models"] = 403
        dialog.search()
        qtbot.waitUntil(dialog.error.isVisible, timeout=10_000)
        assert "HTTP 403" in dialog.error.message_label.text()
        return
    dialog.query.setText("gemma")
    dialog.search()
    qtbot.waitUntil(lambda: dialog.results.rowCount() == 1, timeout=10_000)
    dialog.select_repo("gated-org/tiny-gemma-GGUF")
    qtbot.waitUntil(dialog.error.isVisible, timeout=10_000)
    assert "gated" in dialog.error.message_label.text()
    assert "HF_TOKEN" in dialog.error.hint_label.text()


def test_bad_answers_at_every_step_show_in_the_window(qtbot, hub, monkeypatch):
    """A server error or garbage at each call the dialog makes (search, the file listing, the
    header read, the download) is said in the panel or the file's cell; the dialog goes on."""
    from tests.hub_server import count_attempts

    count_attempts(monkeypatch)                     # the client's retries of a 5xx, at once
    dialog = GetModelDialog()
    qtbot.addWidget(dialog)
    dialog.show()

    def shown(fault):
        qtbot.waitUntil(dialog.error.isVisible, timeout=10_000)
        text = dialog.error.message_label.text()
        assert fault in text, text
        dialog.error.hide()

    hub.garbage.add("/api/models")
    dialog.query.setText("tiny")
    dialog.search()
    shown("does not understand")
    hub.garbage.clear()
    hub.status["/api/models"] = 500                 # the search and the listing
    dialog.search()
    shown("HTTP 500")
    hub.status.clear()
    dialog.search()
    qtbot.waitUntil(lambda: dialog.results.rowCount() > 0, timeout=10_000)
    hub.garbage.add("/tree/")
    dialog.select_repo(LLAMA)
    shown("does not understand")
    hub.garbage.clear()
    hub.status["/resolve/"] = 500                   # the header reads and the download
    dialog.results.clearSelection()
    dialog.select_repo(LLAMA)
    qtbot.waitUntil(lambda: len(dialog.fits) == len(dialog.models) > 0, timeout=10_000)
    cells = [dialog.files.item(r, 3).text() for r in range(dialog.files.rowCount())]
    assert all(c.startswith("cannot read the header:") and "HTTP 500" in c for c in cells), cells
    dialog.select_file(Q8)
    dialog.download_button.click()
    shown("HTTP 500")
    assert not dialog.is_downloading() and dialog.search_button.isEnabled()
    assert dialog.download_button.isEnabled()       # to try again
    os.makedirs("/tmp/shots", exist_ok=True)
    dialog.grab().save("/tmp/shots/get-model-bad-answers.png")
