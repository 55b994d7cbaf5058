"""Where a command may write: one rule for every writer of a file the user names (exports of
every format with their `.verify.json` reports, `new-model`, `logits`).

`check_destination(path, overwrite=..., inputs=...)` refuses, before anything is written:

- a name longer than MAX_NAME bytes: the writers put files named after it beside it (a
  temporary `NAME.tmp-PID`, a staging `.NAME.partial-PID`, `NAME.verify.json`, a
  `NAME.failed-verification` copy), which must fit the file system's NAME_MAX too;
- never, even with overwrite: one of the command's inputs (or of the run it exports: model,
  dataset, validation data, weights, prompts, reward files, adapter, the run's own files), the
  same file compared through symbolic links (resolved paths) and hard links (device and inode);
  a destination inside an input folder (a checkpoint, a PEFT folder), or a folder destination
  holding one;
- never, even with overwrite: a run folder's own files, of any run (a folder holding
  config.json and checkpoints/, as `rundir.check_not_nested` tells a run folder): its
  config.json, status.json, metrics.jsonl, log.txt, run.lock, adapter.gguf, anything in
  checkpoints/, or the run folder itself. Its exports/ folder and new names beside them are fine;
- never, even with overwrite: anything but a regular file where a file goes (a folder, a
  device node, a FIFO, a socket: replacing /dev/full with a file is not an export), or anything
  but a folder where a folder goes;
- without overwrite: anything at `path` (an empty folder, for a folder, holds nothing to lose).

Writers then write beside `path` and rename into place (`runtime.files`), so they never write
through a link either: a link at `path` is replaced, its target is left alone.

What this cannot see: a hard link, somewhere else, to a file of a run the command does not
read (nothing names a file's other links); the files of the run an export reads are among its
inputs, so links to those are compared by inode like any input.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from app.engine.errors import ConfigError
from app.engine.evaluation.runner import parse_task
from app.engine.runs.rundir import (CHECKPOINTS, CONFIG, LOG, METRICS, STATUS, RunDir,
                                    enclosing_run)
from app.engine.runs.runlock import LOCK
from app.engine.runtime.files import NAME_MAX, storage_error

# Bytes the writers add to a destination's name (".failed-verification-N" then ".verify.json"
# is the longest: 36), with a margin.
NAME_RESERVE = 40
MAX_NAME = NAME_MAX - NAME_RESERVE
FINAL_ADAPTER = "adapter.gguf"        # the adapter a finished run saves beside its config.json
RUN_FILES = (CONFIG, STATUS, METRICS, LOG, LOCK, FINAL_ADAPTER, CHECKPOINTS)
FAILED = ".failed-verification"

Inputs = Iterable[tuple[str, "str | os.PathLike | None"]]


class DestinationExists(ConfigError):
    """The destination holds a file or a folder already; `overwrite=True` replaces it."""

    def __init__(self, path: Path):
        super().__init__(f"{path} exists already.",
                         "Pass --overwrite to replace it, or choose another path (--out).")
        self.path = path


def _real(path: str | os.PathLike) -> Path:
    return Path(os.path.normcase(os.path.realpath(path)))


def _stat(path: str | os.PathLike) -> os.stat_result | None:
    try:
        return os.stat(path)
    except (OSError, ValueError):
        return None


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether a and b name one file or folder: the same resolved path (symbolic links), or
    the same device and inode (hard links)."""
    if _real(a) == _real(b):
        return True
    sa, sb = _stat(a), _stat(b)
    return sa is not None and sb is not None and (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    real, real_folder = _real(path), _real(folder)
    return real != real_folder and real.is_relative_to(real_folder)


def _run_file(path: Path) -> tuple[RunDir, str] | None:
    """(the run, what of it) when `path`, as named or resolved through links, is a run folder
    or one of a run's own files (RUN_FILES, or anything inside its checkpoints/)."""
    for candidate in dict.fromkeys((path, _real(path))):
        run = enclosing_run(candidate)
        if run is None:
            continue
        if candidate == run.path:
            return run, "its folder"
        first = candidate.relative_to(run.path).parts[0]
        if first in RUN_FILES:
            return run, first if first != CHECKPOINTS else "its checkpoints"
    return None


def run_inputs(run_dir: str | os.PathLike) -> list[tuple[str, Path]]:
    """What a run reads, as its config.json names it (relative paths as the run's command saw
    them: from the current folder), and its own files: never an export's destination."""
    run = RunDir(run_dir)
    config = run.config()
    data = config.get("data_config") if isinstance(config.get("data_config"), dict) else {}
    named = [("the run's model", config.get("model")), ("the run's dataset", config.get("data")),
             ("the run's prompts", config.get("prompts")),
             ("the run's validation data", data.get("val_path")),
             ("the run's weights file", data.get("weights_path")),
             ("the adapter the run started from", config.get("adapter"))]
    rewards = config.get("rewards") if isinstance(config.get("rewards"), list) else []
    named += [("the run's reward file", r.get("arg")) for r in rewards
              if isinstance(r, dict) and r.get("kind") == "file"]
    task = config.get("eval_task")
    if isinstance(task, str) and task:            # KIND:PATH (issue 32); not one: no file
        try:
            named.append(("the run's evaluation task", parse_task(task).path))
        except ConfigError:
            pass
    found = [(label, Path(p).expanduser().absolute()) for label, p in named
             if isinstance(p, str) and p]
    return found + [(f"the run's {name}", run.path / name) for name in RUN_FILES]


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def check_destination(path: str | os.PathLike, *, overwrite: bool = False, inputs: Inputs = (),
                      what: str = "the output",
                      folder_files: Iterable[str] | None = None,
                      named_after_destination: bool = False) -> Path:
    """Refuse `path` as the destination of `what` (see the module's rules); returns it
    absolute. `inputs`: (label, path) pairs the command reads (None paths are skipped);
    `folder_files`: the names a folder destination holds (None: the destination is a file).
    `named_after_destination`: `path` is a file a writer names after the destination the user
    gave (an export's NAME.verify.json), whose length that destination's check covered
    (NAME_RESERVE): the limit is said of the name the user typed, never of this one.
    Raises ConfigError (DestinationExists when only --overwrite is missing)."""
    out = Path(path).expanduser().absolute()
    size = len(os.fsencode(out.name))
    if size > MAX_NAME and not named_after_destination:
        raise ConfigError(f"The name {out.name[:40]}... is {size} bytes long; {what} may have "
                          f"at most {MAX_NAME} (the file system allows {NAME_MAX}, and files "
                          "named after it are written beside it).", "Choose a shorter name.")
    folder = folder_files is not None
    for label, source in inputs:
        if source is None:
            continue
        if same_file(out, source) or _inside(out, source) or (folder and _inside(source, out)):
            raise ConfigError(f"Writing {what} to {out} would write over {label} ({source}).",
                              "The workbench never replaces a command's own inputs, not even "
                              "when allowed to replace its output (--overwrite): choose "
                              "another path.")
    owner = _run_file(out)
    if owner is not None:
        run, part = owner
        raise ConfigError(f"Writing {what} to {out} would write over {part} of the run "
                          f"{run.path}.", "A run's own files are never replaced, not even with "
                          f"--overwrite: write into its {run.exports_dir.name}/ folder or "
                          "elsewhere.")
    if not os.path.lexists(out):
        return out
    st = _stat(out)                    # None: a dangling link (replacing it loses nothing)
    if st is not None and folder and not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{out} is {_kind(st.st_mode)}, and {what} is a folder.",
                          "Choose another path (--out).")
    if st is not None and not folder and not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{out} is {_kind(st.st_mode)}, and {what} is one regular file.",
                          "Choose another path (--out).")
    if folder and not out.is_symlink():
        held = os.listdir(out)
        foreign = sorted(set(held) - set(folder_files))
        if foreign:
            raise ConfigError(f"{out} holds files {what} does not write "
                              f"({', '.join(foreign[:5])}); replacing the folder would delete "
                              "them.", "Choose a new folder (--out).")
        if not held:
            return out
    if not overwrite:
        raise DestinationExists(out)
    return out


def make_parent(path: Path) -> None:
    """Make the folder `path` goes in (and the missing ones above it); a folder that cannot be
    made (read-only, a full disk, a file in the way) is a StorageError naming it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise storage_error(e, Path(e.filename or path.parent), "create the folder") from e


def failed_path(path: Path) -> Path:
    """A new name beside `path` for an output that failed verification:
    `<stem>.failed-verification<suffix>` (then `-2`, `-3`, ... until one is free)."""
    stem, suffix = (path.name, "") if path.is_dir() or not path.suffix else (path.stem,
                                                                              path.suffix)
    n = 1
    while True:
        candidate = path.with_name(f"{stem}{FAILED}{f'-{n}' if n > 1 else ''}{suffix}")
        if not os.path.lexists(candidate):
            return candidate
        n += 1
