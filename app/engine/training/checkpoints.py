"""Atomic, checksummed checkpoints of a training session, and exact resume.

A checkpoint is a folder `step-<N>/` with `arrays.npz` (the trained tensors: LoRA A/B and
fully trained tensors, and the optimizer's arrays), `meta.json` (step, optimizer scalars,
data position, anything the run loop adds) and `manifest.json` (the sha256 of the other two).
It is written into a temporary folder, every file fsynced, then renamed into place: a folder
named `step-<N>` is always complete, and a crash mid-write leaves only a `.tmp-*` folder that
is ignored and cleaned up. Loading checks the checksums, so a file damaged later (truncated,
altered, deleted) is a DamagedCheckpoint, never a wrong state or a traceback. Checkpoints from
before checksums (no manifest, no "format" in meta.json) still load. Nothing random needs
saving: dropout masks and data order derive from (seed, step, position).

Nothing is written or deleted through a symbolic link (`own_folder`): a `checkpoints/` or
`step-<N>` that is a link (a run folder copied with its links) would have new steps written
into the link's target and the target's old steps deleted by pruning. Reading through links
(loading, listing) stays allowed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.engine.errors import CheckpointError
from app.engine.runtime.files import link_error, open_regular, read_own_bytes

SEP = "/"  # joins nested keys in arrays.npz (tensor names contain dots, never slashes)
ARRAYS, META, MANIFEST = "arrays.npz", "meta.json", "manifest.json"
FORMAT = 2   # meta.json's "format": 2 has a manifest; checkpoints without "format" predate it


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files are missing, truncated, altered or unreadable."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"Checkpoint {path} is damaged ({reason}).",
                         "Use an earlier checkpoint (workbench resume RUN_DIR --step N) or "
                         "restart the run.")
        self.reason = reason


def _flatten(tree: dict, prefix: str = "") -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Split a nested dict into arrays (by joined key) and a JSON-able rest."""
    arrays, rest = {}, {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            sub_arrays, rest[key] = _flatten(value, path + SEP)
            arrays.update(sub_arrays)
        elif isinstance(value, np.ndarray):
            arrays[path] = value
            rest[key] = {"__array__": path}
        else:
            rest[key] = value
    return arrays, rest


def _unflatten(rest: dict, arrays) -> dict:
    out = {}
    for key, value in rest.items():
        if isinstance(value, dict) and "__array__" in value:
            out[key] = arrays[value["__array__"]]
        elif isinstance(value, dict):
            out[key] = _unflatten(value, arrays)
        else:
            out[key] = value
    return out


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with os.fdopen(open_regular(path, "checkpoint file", error=CheckpointError, own=True),
                   "rb") as f:   # a FIFO or a device in its place: an error, never a hang
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_meta(path: Path) -> bytes:
    """A checkpoint's meta.json or manifest.json: a regular file of at most JSON_MAX_BYTES
    (files.read_own_bytes), else CheckpointError; OSErrors as they are."""
    return read_own_bytes(path, "checkpoint file", error=CheckpointError)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def own_folder(path: str | os.PathLike) -> Path:
    """`path` (the run's checkpoints folder, or a folder in it; the exporter asks it of the
    run's exports/), once it is known not to be a symbolic link: this module writes, renames and
    deletes only in folders of the run itself.
    A link is a StorageError naming it (`link_error`); a missing path is fine (made later)."""
    path = Path(path)
    if path.is_symlink():
        raise link_error(path)
    return path


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    state: dict          # TrainSession.state_dict()
    meta: dict           # what the run loop stored (data position, metrics, ...)


def save_checkpoint(folder: str | os.PathLike, step: int, state: dict,
                    meta: dict | None = None) -> Path:
    """Write `folder/step-<step>` atomically; returns its path. Raises CheckpointError."""
    folder = own_folder(folder)
    final = own_folder(folder / f"step-{step}")
    tmp = own_folder(folder / f".tmp-step-{step}-{os.getpid()}")
    arrays, rest = _flatten(state)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        with open(tmp / ARRAYS, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        meta_bytes = json.dumps({"format": FORMAT, "step": step, "state": rest,
                                 "meta": meta or {}}).encode()
        _write(tmp / META, meta_bytes)
        sums = {ARRAYS: _sha256(tmp / ARRAYS), META: hashlib.sha256(meta_bytes).hexdigest()}
        _write(tmp / MANIFEST, json.dumps({"sha256": sums}).encode())
        _fsync_dir(tmp)
        if final.exists():              # re-saving a step (e.g. the final one): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(folder)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        hint = ("The disk is full: free space or pick another run folder; the previous "
                "checkpoints are intact." if e.errno == 28 else "Check the run folder.")
        raise CheckpointError(f"Could not write checkpoint step {step}: {e.strerror or e}.",
                              hint) from e
    return final


def _verify(path: Path) -> bool:
    """Check the files against manifest.json; False when there is none (an older checkpoint)."""
    try:
        raw = read_meta(path / MANIFEST)
    except FileNotFoundError:
        return False
    try:
        sums = json.loads(raw)["sha256"]
    except (ValueError, KeyError, TypeError):
        raise DamagedCheckpoint(path, f"{MANIFEST} is unreadable") from None
    if not isinstance(sums, dict) or set(sums) != {ARRAYS, META}:
        raise DamagedCheckpoint(path, f"{MANIFEST} does not list {ARRAYS} and {META}")
    actual = {ARRAYS: _sha256(path / ARRAYS),   # meta.json read as JSON is, within its cap
              META: hashlib.sha256(read_meta(path / META)).hexdigest()}
    for name in (ARRAYS, META):
        if actual[name] != sums[name]:
            raise DamagedCheckpoint(path, f"{name} does not match its checksum")
    return True


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Load a checkpoint, checking its checksums; any damage raises DamagedCheckpoint."""
    path = Path(path)
    try:
        verified = _verify(path)
        meta = json.loads(read_meta(path / META))
        if not isinstance(meta, dict) or not isinstance(meta.get("state"), dict):
            raise DamagedCheckpoint(path, f"{META} holds no checkpoint state")
        if not verified and "format" in meta:
            raise DamagedCheckpoint(path, f"{MANIFEST} is missing")
        with os.fdopen(open_regular(path / ARRAYS, "checkpoint file", error=CheckpointError,
                                    own=True), "rb") as f, np.load(f) as npz:
            arrays = {k: npz[k] for k in npz.files}
        return Checkpoint(path, int(meta["step"]), _unflatten(meta["state"], arrays),
                          meta.get("meta", {}))
    except FileNotFoundError as e:
        raise DamagedCheckpoint(path, f"{Path(e.filename).name} is missing") from e
    # an older checkpoint has no checksums: its damage shows up as a parse error (zipfile
    # answers some altered headers with NotImplementedError or RuntimeError: "encrypted")
    except DamagedCheckpoint:
        raise
    except CheckpointError as e:      # a file that is not one, or too large (files.check_regular)
        raise DamagedCheckpoint(path, e.message) from e
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile,
            NotImplementedError, RuntimeError) as e:
        raise DamagedCheckpoint(path, f"{type(e).__name__}: {e}") from e


def list_checkpoints(folder: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders are not checkpoints, nor is a
    `step-<N>` folder that holds another run: `nested_runs`)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit() and not _a_run(p):
            found.append((int(p.name[5:]), p))
    return [p for _, p in sorted(found)]


def nested_runs(folder: str | os.PathLike) -> list[Path]:
    """`step-<N>` folders in `folder` that hold a run (its config.json) rather than a
    checkpoint: never resumed from, set aside, pruned or exported, only left alone and named.
    (The workbench refuses to make a run there; another program or an older one may have.)"""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("step-*") if p.is_dir() and _a_run(p))


def _a_run(path: Path) -> bool:
    return (path / "config.json").is_file()   # app.engine.runs.rundir.CONFIG (a layer above)


def set_aside(path: Path, why: str) -> Path:
    """Rename checkpoint `path` to `step-<N>.<why>`: kept for inspection, no longer listed
    (resumed from, pruned or exported). Returns the new path."""
    own_folder(path.parent)
    target = own_folder(path.with_name(f"{path.name}.{why}"))
    try:
        shutil.rmtree(target, ignore_errors=True)
        os.rename(path, target)
    except OSError as e:
        raise CheckpointError(f"Could not rename {path} to {target.name}: {e.strerror or e}.",
                              "Check the run folder's permissions.") from e
    return target


def rewind(folder: str | os.PathLike, step: int) -> list[Path]:
    """Make checkpoint `step` the newest one (`workbench resume --step`): check that it loads,
    then set the newer ones aside as `step-<N>.skipped`, so that they are neither resumed from
    nor mixed with the checkpoints of the resumed run. Returns the set-aside folders. Raises
    CheckpointError, listing the intact steps, when `step` is absent or damaged."""
    found = list_checkpoints(folder)
    chosen = Path(folder) / f"step-{step}"
    if chosen not in found:
        problem = f"there is no checkpoint step-{step}"
    else:
        try:
            load_checkpoint(chosen)
        except DamagedCheckpoint as e:
            problem = f"checkpoint step-{step} is damaged ({e.reason})"
        else:
            return [set_aside(p, "skipped") for p in found if int(p.name[5:]) > step]
    intact = [p.name[5:] for p in found if p != chosen and _intact(p)]
    raise CheckpointError(f"Cannot resume from step {step}: {problem}.",
                          f"Intact checkpoints: steps {', '.join(intact)}." if intact
                          else "No checkpoint of the run is intact. " + restart_hint(folder))


def _intact(path: Path) -> bool:
    try:
        load_checkpoint(path)
    except DamagedCheckpoint:
        return False
    return True


def restart_hint(folder: str | os.PathLike) -> str:
    """What to do when no checkpoint in the run's `folder` (RUN_DIR/checkpoints) is usable."""
    config = Path(folder).parent / "config.json"
    return (f"Start the run again from its settings: workbench train --config {config} "
            f"(a GRPO run: workbench grpo --config {config}).")


def newest_intact(folder: str | os.PathLike) -> tuple[Checkpoint | None, list[tuple[Path, str]]]:
    """The newest checkpoint in `folder` that loads (None: none does, or there is none), and
    the damaged newer ones as (path, reason), newest first: what resume and export fall back
    to and what they say they skipped."""
    damaged = []
    for path in reversed(list_checkpoints(folder)):
        try:
            return load_checkpoint(path), damaged
        except DamagedCheckpoint as e:
            damaged.append((path, e.reason))
    return None, damaged


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    found = list_checkpoints(folder)
    return found[-1] if found else None


def best_checkpoint(folder: str | os.PathLike) -> tuple[int, Path, float] | None:
    """(step, path, metric) of the best kept checkpoint, as the run loop recorded it in its
    newest readable checkpoint's run state ("best_step" with "best_loss" (supervised),
    "best_reward" (GRPO) or "best_accuracy" (preference runs)); None when no evaluation made
    one (or it is no longer there)."""
    for path in reversed(list_checkpoints(folder)):
        try:
            run = json.loads(read_meta(path / META))["meta"]["run"]
        except (OSError, CheckpointError, ValueError, KeyError, TypeError):
            continue
        step = run.get("best_step")
        metric = run.get("best_loss", run.get("best_reward", run.get("best_accuracy")))
        best = Path(folder) / f"step-{step}"
        if step and isinstance(metric, (int, float)) and best in list_checkpoints(folder):
            return step, best, float(metric)
        return None
    return None


def prune_checkpoints(folder: str | os.PathLike, keep_last: int, keep: tuple[int, ...] = ()) -> None:
    """Delete all but the newest `keep_last` checkpoints and the steps in `keep` (the best),
    and any temporary folders left by a crash."""
    folder = own_folder(folder)
    found = list_checkpoints(folder)
    doomed = found[:-keep_last] if keep_last > 0 else found
    for p in doomed:
        if int(p.name[5:]) not in keep:
            shutil.rmtree(own_folder(p), ignore_errors=True)
    if folder.is_dir():
        for p in folder.glob(".tmp-step-*"):
            shutil.rmtree(own_folder(p), ignore_errors=True)
