"""Where the workbench keeps the user's state: the job queue's database and, beside it, the
list of runs, the trusted reward files and the clusters. $WORKBENCH_QUEUE moves them all (tests
keep them private this way).

Nothing makes the state folder ahead of time: every writer of a state file makes its folder
when it writes (`state_file`), so the first command of a new user works, whichever it is.
Folders made this way are user-private (0700), as the XDG base-directory spec asks of the
folders it names; a folder that already exists keeps its permissions."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

from app.engine.runtime.files import StorageError, storage_error

ENV_VAR = "WORKBENCH_QUEUE"
STATE_DIR_MODE = 0o700


def default_queue_path() -> Path:
    """$WORKBENCH_QUEUE, else queue.sqlite3 in the user data directory."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_data_dir("gguf-workbench")) / "queue.sqlite3"


def user_state_dir() -> Path:
    """The folder of the queue's database: the user's workbench state."""
    return default_queue_path().parent


def ensure_state_dir(folder: str | os.PathLike | None = None) -> Path:
    """Make `folder` (default: `user_state_dir()`) and each missing folder above it, mode 0700;
    returns it. StorageError naming the folder and why (DiskFullError for a full disk)."""
    folder = Path(folder) if folder is not None else user_state_dir()
    missing = []
    for d in (folder, *folder.parents):
        if d.is_dir():
            break
        missing.append(d)
    for d in reversed(missing):
        try:
            d.mkdir(mode=STATE_DIR_MODE)
        except FileExistsError:   # made meanwhile by another process, or a file: checked below
            pass
        except OSError as e:
            raise storage_error(e, d, "create the folder") from e
    if not folder.is_dir():
        raise StorageError(f"Could not create the folder {folder}: a file of that name is "
                           "in the way.", "Move or rename that file.")
    return folder


def state_file(path: str | os.PathLike) -> Path:
    """`path`, a file of the user's state, once its folder exists (`ensure_state_dir`)."""
    path = Path(path)
    ensure_state_dir(path.parent)
    return path
