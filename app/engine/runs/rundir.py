"""A run directory: everything about one training run, and the API between GUI, CLI and worker.

```
RUN_DIR/
  config.json      the run as submitted (plus resolved defaults); written once, atomically
  status.json      state, step, total_steps, epoch, loss, eta_s, updated_at, writer, error...;
                   atomic
  metrics.jsonl    one JSON object per line: the events of app.engine.training.events; appended
  log.txt          human-readable log lines; appended
  checkpoints/     step-N/ directories (written by app.engine.training.checkpoints)
  exports/         adapters and merged models
```

Whole files are replaced atomically (temporary file in the same directory, fsync, `os.replace`),
so a reader never sees a half-written `config.json` or `status.json` and a crash keeps the old
file. Appended files are written one line per `write` call on an O_APPEND descriptor; a reader
tailing `metrics.jsonl` with `read_metrics(offset)` only ever returns complete lines.

Files are written and read through `app.engine.runtime.files` (atomic writes, appends, JSON).
Bad files raise EngineErrors (never a bare OSError or JSONDecodeError); a full disk raises
`DiskFullError` and leaves the previous files intact.

Every status write records its writer (host, pid, process start time), so that a reader sees a
"running" run whose process died without a word (kill -9, a crash) as "interrupted".
"""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from app.engine.errors import ConfigError, EngineError
from app.engine.runs.registry import register_run, registry_entries
from app.engine.runtime.files import (NAME_MAX, StorageError, append_line, atomic_write_json,
                                      loads_json, open_regular, read_json, size_text,
                                      storage_error, to_json)
from app.engine.runtime.paths import ensure_state_dir
from app.engine.runtime.processes import pid_alive, process_started
from app.engine.training.checkpoints import best_checkpoint as best_in_folder
from app.engine.training.events import EVAL, STEP, TIME, TYPE, event_type

CONFIG = "config.json"
STATUS = "status.json"
METRICS = "metrics.jsonl"
LOG = "log.txt"
CHECKPOINTS = "checkpoints"
EXPORTS = "exports"

RUN_NAME_MAX = NAME_MAX - 8   # a new run's name: room for the "-N" that makes it unique
METRICS_READ_MAX = 64 << 20   # bytes of metrics.jsonl read at once: 50,000 steps or more


# --------------------------------------------------------------------------- the run directory


class RunDir:
    """One run's directory. Cheap to construct; nothing is read until asked."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser().absolute()

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunDir) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)

    # ---------------------------------------------------------------- layout
    @property
    def config_path(self) -> Path:
        return self.path / CONFIG

    @property
    def status_path(self) -> Path:
        return self.path / STATUS

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS

    @property
    def log_path(self) -> Path:
        return self.path / LOG

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def exports_dir(self) -> Path:
        return self.path / EXPORTS

    @property
    def name(self) -> str:
        return self.path.name

    def exists(self) -> bool:
        """True when the directory holds a config.json (is a run directory); False for a path
        the system refuses (too long, a NUL)."""
        try:
            return self.config_path.is_file()
        except (OSError, ValueError):
            return False

    # ---------------------------------------------------------------- creation and config
    @classmethod
    def create(cls, path: str | os.PathLike, config: dict, *, exist_ok: bool = False) -> "RunDir":
        """Make the directory (and checkpoints/, exports/) and write config.json atomically.

        An existing run (a config.json already there) raises ConfigError unless `exist_ok`,
        in which case the config is replaced; so does a folder inside another run's
        (`check_not_nested`) or one that holds a run below it (`check_holds_no_run`): the CLI
        and the window alike. The run joins the user's list of runs
        (app.engine.runs.registry), wherever its folder is. The user's state folder is made
        first, so that it cannot fail with a run half made; any later failure takes back what
        was made (`take_back`).
        """
        if not isinstance(config, dict):
            raise ConfigError(f"A run's config must be a JSON object, got {type(config).__name__}.")
        run = cls(path)
        check_path_length(run.path)
        config_existed = run.config_path.exists()
        if config_existed and not exist_ok:
            raise ConfigError(f"{run.path} already holds a run (config.json exists).",
                              "Choose another output folder, or resume that run.")
        check_not_nested(run.path)
        check_holds_no_run(run.path)
        ensure_state_dir()
        existed = run.path.is_dir()
        try:
            for d in (run.path, run.checkpoints_dir, run.exports_dir):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            run.take_back(existed, config_existed)
            raise storage_error(e, run.path, "create") from e
        try:
            run.write_config(config)
            register_run(run.path, config)
        except BaseException:
            run.take_back(existed, config_existed)
            raise
        return run

    def take_back(self, existed: bool, config_existed: bool = False) -> None:
        """Undo `create` after a failure (or a queue that refused the run), so that the same
        command works next time: remove the folder it made, or, in a folder that was there
        before (`existed`), the config.json it wrote (unless one was there:
        `config_existed`) and its empty checkpoints/ and exports/. Best effort: never raises."""
        import shutil

        if not existed:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        if not config_existed:
            self.config_path.unlink(missing_ok=True)
        for folder in (self.checkpoints_dir, self.exports_dir):
            try:
                folder.rmdir()  # only if empty
            except OSError:
                pass

    def write_config(self, config: dict) -> None:
        atomic_write_json(self.config_path, config)

    def config(self) -> dict:
        """config.json as a dict; missing or corrupt raises ConfigError with a hint."""
        if not self.path.is_dir():
            raise ConfigError(f"The run directory {self.path} does not exist.",
                              "Check the path, or create the run first (workbench train --out).")
        if not self.config_path.exists():
            raise ConfigError(f"{self.path} is not a run directory: it has no {CONFIG}.",
                              "Create the run first (workbench train --queue writes it).")
        cfg = read_json(self.config_path, what="run config", error_cls=ConfigError)
        if not isinstance(cfg, dict):
            raise ConfigError(f"The run config {self.config_path} is not a JSON object.",
                              "Recreate the run.")
        return cfg

    # ---------------------------------------------------------------- status
    def status(self) -> dict:
        """status.json as a dict ({} before the first write); corrupt raises StorageError.
        A "running" status whose writer is gone reads as "interrupted" (resumable), no ETA."""
        st = read_json(self.status_path, what="run status", missing_ok=True)
        if st is None:
            return {}
        if not isinstance(st, dict):
            raise StorageError(f"The run status {self.status_path} is not a JSON object.",
                               "Delete status.json; the worker rewrites it.")
        if st.get("state") == "running" and _writer_gone(st.get("writer")):
            st["state"] = "interrupted"
            st.pop("eta_s", None)
        return st

    def write_status(self, *, replace: bool = False, fsync: bool = True, **fields) -> dict:
        """Merge `fields` into status.json (or replace it) and stamp `updated_at`; atomic.

        A corrupt previous status is overwritten rather than refused (status is derived state).
        Returns the status written.
        """
        st: dict = {}
        if not replace:
            try:
                st = self.status()
            except StorageError:
                st = {}
        st.update(fields)
        st["updated_at"] = time.time()
        st["writer"] = {"host": socket.gethostname(), "pid": os.getpid(),
                        "started": process_started(os.getpid())}
        atomic_write_json(self.status_path, st, fsync=fsync)
        return st

    # ---------------------------------------------------------------- metrics and log
    def append_metrics(self, event: dict) -> dict:
        """Append one event as a JSON line. `type` defaults to "step", `time` to now.

        Returns the event as written (with type and time). Non-JSON values (numpy scalars and
        arrays) are converted; anything else unserialisable raises TypeError (a bug).
        """
        ev = dict(event)
        ev.setdefault(TYPE, STEP)
        ev.setdefault(TIME, time.time())
        line = to_json(ev)
        append_line(self.metrics_path, line)
        return ev

    def read_metrics(self, since_offset: int = 0) -> tuple[list[dict], int]:
        """Complete events after byte `since_offset`, and the offset to pass next time.

        A trailing line without its newline (being written, or torn by a crash) is not
        returned and the offset stays before it. Lines that are not JSON objects (a torn line
        terminated later) are skipped. If the file shrank below the offset (replaced), reading
        restarts at 0. A missing file gives ([], 0). At most the last METRICS_READ_MAX bytes
        after the offset are read (from the first line break in them): a long run's
        list row, summary or curves need its last events, and a file that is not a run's
        metrics (a 20 GB sparse file) costs one bounded read. Anything but a regular file (a
        FIFO, a link to /dev/zero) is a StorageError, never a read that blocks or never ends.
        """
        try:
            with os.fdopen(open_regular(self.metrics_path, "run metrics", own=True), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if since_offset > size:
                    since_offset = 0
                start = max(since_offset, size - METRICS_READ_MAX)
                f.seek(start)
                data = f.read(size - start)
        except FileNotFoundError:
            return [], 0
        except OSError as e:
            raise storage_error(e, self.metrics_path, "read") from e
        end = data.rfind(b"\n")
        if end < 0:
            return [], since_offset
        first = 0 if start == since_offset else data.find(b"\n") + 1   # a line cut by the start
        events = []
        for raw in data[first:end].split(b"\n"):
            if not raw.strip():
                continue
            try:
                ev = loads_json(raw.decode("utf-8"))   # a line nested too deeply is skipped too
            except (UnicodeDecodeError, ValueError):
                continue
            if isinstance(ev, dict):
                events.append(ev)
        return events, start + end + 1

    def metrics(self) -> list[dict]:
        """Every complete event in metrics.jsonl, deduplicated by step (`dedupe_steps`)."""
        return dedupe_steps(self.read_metrics(0)[0])

    def log(self, line: str) -> None:
        """Append a timestamped line to log.txt (multi-line text is kept together)."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        append_line(self.log_path, f"{stamp} {line.rstrip()}")

    # ---------------------------------------------------------------- summary
    def summary(self) -> dict:
        """What `workbench runs show` prints: config, status, final and best metrics.

        `final[type]` is the last event of each type; `best[type]` is the event with the
        lowest finite `loss` among events of that type (step, eval). Never raises for a
        broken run: problems are reported under `problems`.
        """
        out: dict = {"run_dir": str(self.path), "config": None, "status": {}, "final": {},
                     "best": {}, "events": 0, "problems": []}
        try:
            out["config"] = self.config()
        except EngineError as e:
            out["problems"].append(e.message)
        try:
            out["status"] = self.status()
        except EngineError as e:
            out["problems"].append(e.message)
        try:
            events = self.metrics()
        except EngineError as e:
            out["problems"].append(e.message)
            events = []
        try:
            size = self.metrics_path.stat().st_size
        except OSError:
            size = 0
        if size > METRICS_READ_MAX:
            out["problems"].append(f"Only the last {size_text(METRICS_READ_MAX)} of {METRICS} "
                                   f"({size_text(size)}) were read.")
        out["events"] = len(events)
        out["final"], out["best"] = summarize_metrics(events)
        return out


def _writer_gone(writer: Any) -> bool:
    """Has the process that wrote a status ended? Known only for a writer on this host."""
    if not isinstance(writer, dict) or writer.get("host") != socket.gethostname():
        return False
    pid = writer.get("pid")
    if not isinstance(pid, int):
        return False
    if writer.get("started") is not None:    # Linux: also catches the pid's reuse since
        return process_started(pid) != writer["started"]
    return not pid_alive(pid)


def dedupe_steps(events: Iterable[dict]) -> list[dict]:
    """The events of a run whose attempts overlap: an attempt that resumed from a checkpoint
    repeats the steps after it. A step event at or before a step already seen starts the later
    attempt: the earlier attempt's events from that step on (steps, evals, checkpoints...) are
    dropped, so the later event for a step wins. Events without a step are kept."""
    out: list[dict] = []
    last = -math.inf
    for ev in events:
        step = ev.get("step")
        if event_type(ev) == STEP and isinstance(step, (int, float)):
            if step <= last:
                out = [e for e in out
                       if not (isinstance(e.get("step"), (int, float)) and e["step"] >= step)]
            last = step
        out.append(ev)
    return out


def summarize_metrics(events: Iterable[dict]) -> tuple[dict, dict]:
    """(last event per type, lowest-loss event per type for types that carry a loss)."""
    final: dict[str, dict] = {}
    best: dict[str, dict] = {}
    for ev in events:
        kind = event_type(ev)
        final[kind] = ev
        loss = ev.get("loss")
        if isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss):
            if kind not in best or loss < best[kind]["loss"]:
                best[kind] = ev
    return final, best


def check_path_length(path: Path) -> None:
    """ConfigError when a folder name in `path` is longer than file systems allow (an OSError
    on any use of the path otherwise)."""
    for part in path.parts:
        if len(os.fsencode(part)) > NAME_MAX:
            raise ConfigError(f"The folder name {part[:40]}... is {len(os.fsencode(part))} "
                              f"bytes long; file systems allow at most {NAME_MAX}.",
                              "Choose a shorter run name or output folder.")


def enclosing_run(path: Path) -> RunDir | None:
    """The run folder `path` is, or lies in (the nearest one), else None. A run folder holds a
    config.json and a checkpoints/ folder: both are asked, not config.json alone, which many
    projects' folders hold."""
    for folder in (path, *path.parents):
        run = RunDir(folder)
        if run.exists() and run.checkpoints_dir.is_dir():
            return run
    return None


def check_not_nested(path: Path) -> None:
    """ConfigError when `path` is inside another run's folder: its checkpoints would prune,
    resume or export the new run as one of theirs (`train -o RUN/checkpoints/step-99`). The
    folders above are those of the resolved path (through `..` and links)."""
    above = enclosing_run(path.resolve().parent)
    if above is not None:
        raise ConfigError(f"{path} is inside the run folder {above.path}.",
                          "Choose an output folder outside every run's folder.")


RUN_SEARCH_DEPTH = 3          # folders below a new run's folder searched for a run in it
RUN_SEARCH_ENTRIES = 10_000   # ... and entries read at most (a big folder is not a run's)


def check_holds_no_run(path: Path) -> None:
    """ConfigError when the existing folder `path` holds a run below it (`train -o outer`, or
    New run's name for a folder, with `outer/inner` a run): deleting the outer run (the Runs
    screen) would take the inner one with it, and the inner one would lie inside another run
    (`check_not_nested` refuses the other way round). Searched RUN_SEARCH_DEPTH levels deep,
    never through links, reading at most RUN_SEARCH_ENTRIES entries."""
    folders, read = [(path, 0)], 0
    while folders:
        folder, depth = folders.pop()
        try:
            with os.scandir(folder) as entries:
                subfolders = [e for e in entries if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue  # not a folder (a new run's), or unreadable: nothing found there
        read += len(subfolders)
        for entry in subfolders:
            inner = Path(entry.path)
            if (inner / CONFIG).is_file() and (inner / CHECKPOINTS).is_dir():
                raise ConfigError(f"{path} holds the run {inner}.",
                                  "Choose an output folder that holds no run.")
            if depth + 1 < RUN_SEARCH_DEPTH and read < RUN_SEARCH_ENTRIES:
                folders.append((inner, depth + 1))


def default_run_name(stem: str) -> str:
    """A new run's folder name: `YYYYmmdd-HHMMSS-<stem>`, the stem (a dataset's file name)
    shortened, a character at a time, to RUN_NAME_MAX bytes."""
    prefix = time.strftime("%Y%m%d-%H%M%S-")
    while len(os.fsencode(prefix + stem)) > RUN_NAME_MAX:
        stem = stem[:-1]
    return prefix + stem


def default_runs_dir() -> Path:
    """`runs/` in the user data directory (where `workbench train` puts runs by default)."""
    import platformdirs

    return Path(platformdirs.user_data_dir("gguf-workbench")) / "runs"


def list_runs(folder: str | os.PathLike | None = None) -> list[RunDir]:
    """Run directories (holding a config.json) directly under `folder`, newest first."""
    root = Path(folder) if folder is not None else default_runs_dir()
    if not root.is_dir():
        return []
    runs = [RunDir(p) for p in root.iterdir() if p.is_dir() and (p / CONFIG).is_file()]

    def mtime(r: RunDir) -> float:
        try:
            return max(r.config_path.stat().st_mtime,
                       r.status_path.stat().st_mtime if r.status_path.exists() else 0.0)
        except OSError:
            return 0.0

    return sorted(runs, key=lambda r: (-mtime(r), r.name))


def best_checkpoint(run_dir: str | os.PathLike) -> tuple[int, Path, float] | None:
    """(step, path, metric) of the run's best kept checkpoint: the lowest validation loss
    (supervised) or the highest evaluation reward (GRPO); None without evaluations."""
    return best_in_folder(RunDir(run_dir).checkpoints_dir)


@dataclass(frozen=True)
class RunEntry:
    """One row of the user's list of runs (`registered_runs`)."""

    path: Path
    name: str
    kind: str                  # "sft" or "grpo" (app.engine.runs.kinds)
    model: str | None
    dataset: str | None
    created: float             # seconds since the epoch
    state: str                 # status.json's state, "new", or "missing" (the folder is gone)
    duration_s: float | None
    step: int | None
    total_steps: int | None
    best: dict | None          # {"metric": "val_loss"|"reward", "value": v, "step": s}
    executor: str = "local"    # where it runs or ran: "local" or a cluster's name
    attempt: int = 0           # a cluster run's attempt (1, 2... after a lost one or a resume)


def registered_run_paths() -> list[str]:
    """The folders of registered_runs, newest registration first, the default runs folder's
    other runs after them; no run is read (the window polls this)."""
    paths = dict.fromkeys(e["path"] for e in sorted(registry_entries(),
                                                     key=lambda e: -(e["created"] or 0)))
    for run in list_runs():
        paths.setdefault(str(run.path))
    return list(paths)


def registered_runs() -> list[RunEntry]:
    """Every run the workbench created (app.engine.runs.registry) and any other run folder in
    the default runs folder, newest first; a deleted folder is a "missing" entry."""
    entries = {e["path"]: e for e in registry_entries()}
    for run in list_runs():
        entries.setdefault(str(run.path), {"path": str(run.path)})
    rows = [run_entry(path, e) for path, e in entries.items()]
    return sorted(rows, key=lambda r: -r.created)


def run_entry(path: str | os.PathLike, registered: dict | None = None) -> RunEntry:
    """The list row of the run at `path` (`registered`: its registry record, if any)."""
    record = registered or {}
    run = RunDir(path)
    fields = dict(path=run.path, name=run.name, kind=record.get("kind") or "sft",
                  model=record.get("model"), dataset=record.get("dataset"),
                  created=record.get("created") or 0.0, duration_s=None, step=None,
                  total_steps=None, best=None)
    if not os.path.lexists(run.config_path):   # a config.json that is not a file: unreadable
        return RunEntry(state="missing", **fields)
    try:
        config = run.config()
        status = run.status()
        events = run.metrics()
    except EngineError as e:
        return RunEntry(state=f"unreadable: {e.message}", **fields)
    fields.update(kind=config.get("kind", "sft"), model=config.get("model"),
                  dataset=config.get("data") or config.get("prompts"),
                  created=fields["created"] or run.config_path.stat().st_mtime,
                  step=status.get("step"), total_steps=status.get("total_steps"),
                  best=best_evaluation(events), executor=status.get("executor") or "local",
                  attempt=status.get("attempt") or 0)
    started, ended = status.get("started_at"), status.get("finished_at") or status.get("updated_at")
    if isinstance(started, (int, float)) and isinstance(ended, (int, float)):
        fields["duration_s"] = max(ended - started, 0.0)
    return RunEntry(state=status.get("state", "new"), **fields)


def best_evaluation(events: Iterable[dict]) -> dict | None:
    """The best evaluation of a run's events: {"metric", "value", "step"}, the lowest
    validation loss (supervised), the highest mean reward (GRPO) or the highest held-out
    accuracy, then margin (preference runs); None without one."""
    best, best_key = None, None
    for ev in events:
        if event_type(ev) != EVAL:
            continue
        if _finite(ev.get("loss")):
            value, metric, key = ev["loss"], "val_loss", -ev["loss"]
        elif _finite(ev.get("reward_mean")):
            value, metric, key = ev["reward_mean"], "reward", ev["reward_mean"]
        elif _finite(ev.get("eval_rewards/accuracies")):
            value, metric = ev["eval_rewards/accuracies"], "accuracy"
            margin = ev.get("eval_rewards/margins")
            key = (value, margin if _finite(margin) else -math.inf)
        else:
            continue
        if best is None or key > best_key:
            best, best_key = {"metric": metric, "value": value, "step": ev.get("step")}, key
    return best


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
