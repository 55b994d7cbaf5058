"""Settings: the window's own settings (not a run's: those are on New run's Training tab).

One section so far, Clusters (`clusters_panel.ClustersPanel`): the Ray clusters New run's
"Run on" can send a run to.
"""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from app.views.context import AppContext
from app.views.settings.clusters_panel import ClustersPanel


class SettingsView(QWidget):
    """The Settings screen; `clusters` is its Clusters section."""

    def __init__(self, ctx: AppContext, parent: QWidget | None = None):
        super().__init__(parent)
        self.ctx = ctx
        self.clusters = ClustersPanel(ctx)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(20, 16, 20, 16)
        layout.addWidget(QLabel("Settings", objectName="pageTitle"))
        layout.addWidget(QLabel("Where runs can run besides this computer.",
                                objectName="pageSubtitle"))
        layout.addSpacing(8)
        layout.addWidget(QLabel("CLUSTERS", objectName="sectionHeader"))
        layout.addWidget(QLabel("Ray clusters your team runs: New run's \u201cRun on\u201d sends "
                                "a run to one. Runs must live on storage the cluster sees too "
                                "(the path map says where).", objectName="hint",
                                wordWrap=True))
        layout.addWidget(self.clusters, 1)
