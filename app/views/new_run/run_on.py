"""New run's "Run on": this computer, or one of the clusters of Settings > Clusters.

`RunOnBox(ctx)` lists "This computer" and each cluster (read again on `ctx.clusters_changed`:
clusters.json is a small file beside the queue). With no cluster, the list says why there is
no other choice: a disabled item, "No cluster: add one in Settings > Clusters", which is the
box's tooltip too. `executor()` is what `JobQueue.add(..., executor=)` takes ("local" or the
cluster's name); `problem(run_dir)` says why the chosen cluster cannot run a folder (its path
map does not cover it), before anything is queued.
"""

from __future__ import annotations

import os

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QSizePolicy, QWidget

from app.engine.api import LOCAL, Cluster, ConfigError, EngineError
from app.views.widgets.tooltips import RUN_ON_TIP

THIS_COMPUTER = "This computer"
NO_CLUSTER = "No cluster: add one in Settings > Clusters"


class RunOnBox(QWidget):
    """"Run on" and its choices; `changed()` when the choice or the list changes."""

    changed = Signal()

    def __init__(self, ctx, parent: QWidget | None = None):
        super().__init__(parent)
        self.ctx = ctx
        self.clusters: dict[str, Cluster] = {}
        self.combo = QComboBox(objectName="runOn")
        self.combo.setFocusPolicy(Qt.StrongFocus)
        self.combo.setSizeAdjustPolicy(QComboBox.AdjustToMinimumContentsLengthWithIcon)
        self.combo.setMinimumContentsLength(16)         # a cluster's name; the list is wider
        self.setSizePolicy(QSizePolicy.Maximum, QSizePolicy.Preferred)   # no more than it needs
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(QLabel("Run on", objectName="formLabel"))
        layout.addWidget(self.combo)
        self.combo.currentIndexChanged.connect(lambda _i: self.changed.emit())
        ctx.clusters_changed.connect(self.reload)
        self.reload()

    def reload(self) -> None:
        """Read the clusters again; the choice stays when its cluster is still there."""
        keep = self.executor() if self.combo.count() else LOCAL
        why = NO_CLUSTER
        try:
            self.clusters = {c.name: c for c in self.ctx.clusters().list()}
        except EngineError as e:
            self.clusters, why = {}, f"No cluster: {e.message}"
        self.combo.blockSignals(True)
        self.combo.clear()
        self.combo.addItem(THIS_COMPUTER, LOCAL)
        for name in sorted(self.clusters):
            self.combo.addItem(name, name)
            self.combo.setItemData(self.combo.count() - 1, self.clusters[name].url,
                                   Qt.ToolTipRole)
        if not self.clusters:
            self.combo.addItem(why, None)
            item = self.combo.model().item(1)
            item.setEnabled(False)
            item.setToolTip(why)
        self.combo.setToolTip(RUN_ON_TIP if self.clusters else f"{why}\n\n{RUN_ON_TIP}")
        view = self.combo.view()
        view.setMinimumWidth(view.sizeHintForColumn(0) + 24)
        i = self.combo.findData(keep)
        self.combo.setCurrentIndex(max(i, 0))
        self.combo.blockSignals(False)
        self.changed.emit()

    def executor(self) -> str:
        """"local" or the chosen cluster's name."""
        return self.combo.currentData() or LOCAL

    def set_executor(self, name: str) -> None:
        self.combo.setCurrentIndex(max(self.combo.findData(name), 0))

    def cluster(self) -> Cluster | None:
        return self.clusters.get(self.executor())

    def problem(self, run_dir: str | os.PathLike) -> str | None:
        """Why the chosen cluster cannot run `run_dir` (None: it can, or this computer)."""
        cluster = self.cluster()
        if cluster is None:
            return None
        try:
            cluster.cluster_path(run_dir)
        except ConfigError as e:
            return f"{cluster.name} cannot see the run folder: {e.message} {e.hint}"
        return None
