"""Where the workbench keeps the user's state: the job queue's database and, beside it, the
list of trusted reward files. $WORKBENCH_QUEUE moves both (tests keep them private this way)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

ENV_VAR = "WORKBENCH_QUEUE"


def default_queue_path() -> Path:
    """$WORKBENCH_QUEUE, else queue.sqlite3 in the user data directory."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_data_dir("gguf-workbench")) / "queue.sqlite3"


def user_state_dir() -> Path:
    """The folder of the queue's database: the user's workbench state."""
    return default_queue_path().parent
