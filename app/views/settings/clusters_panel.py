"""Settings > Clusters: the Ray clusters runs can be sent to, added, edited and removed.

A list of the clusters (`ctx.clusters()`: clusters.json beside the queue) and an editor: name,
the Ray dashboard's URL, the token (a password field; `ClusterStore.save` keeps it in the OS
keyring, or without one in a file only the user can read, which the panel then says; left empty,
the stored one stays), the path map (LOCAL=CLUSTER,...),
the cluster's Python and the CPUs/GPUs each run asks for. Saving, removing and "Test
connection" (`cluster_test`, what `workbench cluster test` says: the cluster's Ray version and
resources, then a small job there that imports this workbench with the cluster's Python and
checks the path map; or why not) run off the GUI thread (a keyring or an unreachable head can
take seconds, the test job up to two minutes); their errors (a wrong token,
...) show with their hint in the panel. A change emits `ctx.clusters_changed`,
which reloads the list (whoever changed the clusters).
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QHBoxLayout, QLabel, QLineEdit, QListWidget, QPushButton,
                               QVBoxLayout, QWidget)

from app.engine.api import Cluster, ConfigError, EngineError, PathMap, cluster_test
from app.views.context import AppContext, Background
from app.views.widgets.error_panel import ErrorPanel
from app.views.widgets.form_fields import FormBase, dspin
from app.views.widgets.plots import box
from app.views.widgets.tooltips import CLUSTER_TIPS

NEW_TOKEN = "the head's token (kept in the OS keyring, else in a file only you can read)"
KEEP_TOKEN = "leave empty to keep the stored token"


class ClusterForm(FormBase):
    """The fields of one cluster; problems show under their fields when checked (`cluster()`),
    not while typing."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        grid = self._group("Cluster")
        self._row(grid, "name", "Name", QLineEdit(placeholderText="lab-gpus"))
        self._row(grid, "url", "Dashboard URL", QLineEdit(placeholderText="http://head:8265"))
        self._row(grid, "token", "Token", QLineEdit(echoMode=QLineEdit.Password,
                                                   placeholderText=NEW_TOKEN))
        self._row(grid, "path_map", "Path map",
                  QLineEdit(placeholderText="/home/me/runs=/mnt/shared/runs"))
        self._row(grid, "python", "Python on the cluster", QLineEdit(placeholderText="python"))
        self._row(grid, "num_cpus", "CPUs per run", dspin(0, 1024, 1, 1, 1))
        self._row(grid, "num_gpus", "GPUs per run", dspin(0, 64, 0, 2, 1))
        for key in ("num_cpus", "num_gpus"):
            self.fields[key].setMaximumWidth(120)
        self.set_tooltips(CLUSTER_TIPS)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(grid.parentWidget())
        self.set_cluster(None)

    def _changed(self, key: str) -> None:
        self.error_labels[key].hide()                  # edited: its old problem goes
        self.error_labels[key].clear()
        super()._changed(key)

    def validate(self) -> dict[str, str]:
        return self.errors()                           # checked by cluster(), not on edits

    def set_cluster(self, cluster: Cluster | None) -> None:
        """Show `cluster` (None: an empty form for a new one); the token field starts empty."""
        f = self.fields
        self._loading = True
        f["name"].setText(cluster.name if cluster else "")
        f["name"].setReadOnly(cluster is not None)     # renaming: add again, remove the old
        f["url"].setText(cluster.url if cluster else "")
        f["token"].clear()
        f["token"].setPlaceholderText(KEEP_TOKEN if cluster else NEW_TOKEN)
        f["path_map"].setText(str(cluster.path_map) if cluster else "")
        f["python"].setText(cluster.python if cluster else "")
        f["num_cpus"].setValue(cluster.num_cpus if cluster else 1.0)
        f["num_gpus"].setValue(cluster.num_gpus if cluster else 0.0)
        self._loading = False
        self._show_errors({})

    def token(self) -> str:
        return self.fields["token"].text().strip()

    def cluster(self, taken: list[str] = ()) -> Cluster | None:
        """The cluster of the fields, or None with the problems shown under their fields
        (`taken`: names a new cluster may not use)."""
        f = self.fields
        text = {k: f[k].text().strip() for k in ("name", "url", "path_map", "python")}
        errors = {}
        for key, probe in (("name", lambda: Cluster(text["name"], "http://localhost")),
                           ("url", lambda: Cluster("probe", text["url"])),
                           ("path_map", lambda: PathMap.parse(text["path_map"]))):
            try:
                probe()
            except ConfigError as e:
                errors[key] = f"{e.message} {e.hint}"
        if text["name"] in taken:
            errors["name"] = (f"There is a cluster named {text['name']} already: pick it in "
                              "the list to change it.")
        if self._show_errors(errors):
            return None
        return Cluster(text["name"], text["url"], PathMap.parse(text["path_map"]),
                       text["python"] or "python", f["num_cpus"].value(), f["num_gpus"].value())


class ClustersPanel(QWidget):
    """The list of clusters and the editor; see the module docstring."""

    def __init__(self, ctx: AppContext, parent: QWidget | None = None):
        super().__init__(parent)
        self.ctx = ctx
        self.store = ctx.clusters()
        self.current: str | None = None               # the cluster being edited (None: new)
        self._busy = False                            # saving or removing
        self._bg = Background(self, max_threads=2)
        self._answers: list[str] = []                 # Test connection's answers so far
        self._next_answer = lambda: None              # asks cluster_test for the next one
        self.list = QListWidget(objectName="clusterList")
        self.list.setFixedWidth(220)
        self.list.setMaximumHeight(260)               # beside the form, not the whole screen
        self.add_button = QPushButton("Add", toolTip="A new cluster: fill in the form, Save")
        self.remove_button = QPushButton("Remove", toolTip="Forget the selected cluster and "
                                         "its token (runs already sent stay on it)")
        self.form = ClusterForm()
        self.test_button = QPushButton("Test connection",
                                       toolTip="What `workbench cluster test` checks: the "
                                               "cluster's Ray version and resources with this "
                                               "URL and token, then a small job there that "
                                               "imports this workbench with its Python and "
                                               "reads and writes through the path map")
        self.save_button = QPushButton("Save", objectName="primaryButton",
                                       toolTip="Keep the cluster (its token in the OS keyring, or, "
                                               "without one, in a file only you can read)")
        self.test_label = QLabel(objectName="testResult", wordWrap=True,
                                 textFormat=Qt.PlainText)
        self.token_warning = QLabel(objectName="tokenWarning", wordWrap=True,
                                    textFormat=Qt.PlainText)        # coloured by the theme
        self.token_warning.hide()                     # where a token went without a keyring
        self.error_panel = ErrorPanel(margins=0)
        self.error_panel.hide()
        left = box(QVBoxLayout, self.list, box(QHBoxLayout, self.add_button,
                                               self.remove_button), None, widget=True)
        left.setFixedWidth(220)
        right = box(QVBoxLayout, self.form,
                    box(QHBoxLayout, (self.test_label, 1), self.test_button, self.save_button),
                    self.token_warning, self.error_panel, None, widget=True)
        right.setMaximumWidth(820)                    # fields a URL or a path map long
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(16)
        layout.addWidget(left)
        layout.addWidget(right, 1)
        layout.addStretch(0)
        self.list.currentTextChanged.connect(self._on_pick)
        self.add_button.clicked.connect(self.new_cluster)
        self.remove_button.clicked.connect(self.remove)
        self.save_button.clicked.connect(self.save)
        self.test_button.clicked.connect(self.test_connection)
        ctx.clusters_changed.connect(lambda: self.reload())
        self.reload()

    # ---------------------------------------------------------------- the list
    def names(self) -> list[str]:
        return [self.list.item(i).text() for i in range(self.list.count())]

    def reload(self, select: str | None = None) -> None:
        """Read the clusters again (a small JSON file) and select `select` (else the one
        being edited, else the first)."""
        try:
            clusters = {c.name: c for c in self.store.list()}
        except EngineError as e:
            clusters = {}
            self._show_error("Could not read the clusters", e)
        self._clusters = clusters
        self.list.blockSignals(True)
        self.list.clear()
        self.list.addItems(sorted(clusters))
        self.list.blockSignals(False)
        pick = next((n for n in (select, self.current) if n in clusters), None)
        pick = pick or (min(clusters) if clusters else None)
        if pick:
            self.select(pick)
        else:
            self.new_cluster()

    def select(self, name: str) -> None:
        self.list.setCurrentRow(self.names().index(name))
        self._on_pick(name)

    def _on_pick(self, name: str) -> None:
        if name not in self._clusters:
            return
        self.current = name
        self.form.set_cluster(self._clusters[name])
        self._clear_results()
        self._update_buttons()

    def new_cluster(self) -> None:
        """An empty form for a cluster to add."""
        self.current = None
        self.list.blockSignals(True)
        self.list.clearSelection()
        self.list.setCurrentRow(-1)
        self.list.blockSignals(False)
        self.form.set_cluster(None)
        self._clear_results()
        self._update_buttons()
        self.form["name"].setFocus()

    # ---------------------------------------------------------------- actions (off the GUI)
    def save(self) -> None:
        cluster = self.form.cluster([] if self.current else list(self._clusters))
        if cluster is None:
            return
        self._clear_results()
        self._set_busy(True)
        self._bg.run("save", self.store.save, cluster, self.form.token() or None,
                     on_done=lambda warning: self._saved(cluster.name, warning),
                     on_error=lambda e: self._failed(f"Could not save {cluster.name}", e))

    def remove(self) -> None:
        name = self.current
        if name is None:
            return
        self._clear_results()
        self._set_busy(True)
        self._bg.run("remove", self.store.remove, name,
                     on_done=lambda _r: self._changed(None, f"Removed cluster {name}"),
                     on_error=lambda e: self._failed(f"Could not remove {name}", e))

    def test_connection(self) -> None:
        """Ask the cluster in the form (as typed, saved or not) what it is."""
        cluster = self.form.cluster()
        if cluster is None:
            return
        token, store = self.form.token(), self.store
        answers = []                                  # cluster_test's, made in the thread

        def next_answer() -> tuple[str, str] | None:
            if not answers:
                answers.append(cluster_test(cluster, token or store.token(cluster.name)))
            return next(answers[0], None)

        self._clear_results()
        self._answers, self._next_answer = [], next_answer
        self.test_button.setEnabled(False)
        self.test_label.setText(f"Connecting to {cluster.url}\u2026")
        self._bg.run("test", next_answer, on_done=self._tested, on_error=self._test_failed)

    def busy(self) -> bool:
        return self._bg.busy()

    # ---------------------------------------------------------------- results
    def _changed(self, select: str | None, message: str) -> None:
        self._set_busy(False)
        self.current = select
        self.ctx.clusters_changed.emit()              # reloads this list too
        self.ctx.status(message)

    def _saved(self, name: str, warning: str | None) -> None:
        """Saved; `warning` (no OS keyring: the token went to a file only the user can read)
        stays on screen until the next action."""
        self._changed(name, f"Saved cluster {name}")
        if warning:
            self.token_warning.setText(f"\u26a0 {warning}")
            self.token_warning.show()

    def _failed(self, title: str, error: BaseException) -> None:
        self._set_busy(False)                         # the form keeps what was typed
        self._show_error(title, error)

    def _tested(self, answer: tuple[str, str] | None) -> None:
        """One answer of cluster_test shown; the next asked for off the GUI thread (None: all
        answered)."""
        if answer is not None:
            self._answers.append(f"\u2714 {answer[0]}: {answer[1]}")
            self.test_label.setText("\n".join(
                self._answers + ["Running a test job on the cluster\u2026"]))
            self._bg.run("test", self._next_answer, on_done=self._tested,
                         on_error=self._test_failed)
            return
        self.test_button.setEnabled(True)
        self.test_label.setProperty("ok", True)
        self.test_label.setText("\n".join(self._answers))
        self.test_label.style().polish(self.test_label)       # the theme's colour for "ok"

    def _test_failed(self, error: BaseException) -> None:
        self.test_button.setEnabled(True)
        self.test_label.setProperty("ok", False)
        self.test_label.setText("\n".join(self._answers + [
            "\u2716 Cannot run a job" if self._answers else "\u2716 Not connected"]))
        self.test_label.style().polish(self.test_label)
        self._show_error("Test connection failed", error)

    def _show_error(self, title: str, error: BaseException) -> None:
        self.error_panel.show_error(title, error)
        self.error_panel.show()

    def _clear_results(self) -> None:
        self.token_warning.hide()
        self.test_label.clear()
        self.test_label.setProperty("ok", None)
        self.error_panel.hide()

    def _set_busy(self, busy: bool) -> None:
        self._busy = busy
        self._update_buttons()

    def _update_buttons(self) -> None:
        for b in (self.save_button, self.add_button):
            b.setEnabled(not self._busy)
        self.remove_button.setEnabled(not self._busy and self.current is not None)
