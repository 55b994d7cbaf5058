"""Atomic checkpoints of a training session, and exact resume.

A checkpoint is a folder `step-<N>/` with `arrays.npz` (the trained tensors: LoRA A/B and
fully trained tensors, and the optimizer's arrays) and `meta.json` (step, optimizer scalars,
data position, anything the run loop adds). It is written into a temporary folder, every file
fsynced, then renamed into place: a folder named `step-<N>` is always complete, and a crash
mid-write leaves only a `.tmp-*` folder that is ignored and cleaned up. Nothing random needs
saving: dropout masks and data order derive from (seed, step, position).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.engine.errors import CheckpointError

SEP = "/"  # joins nested keys in arrays.npz (tensor names contain dots, never slashes)


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


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    state: dict          # TrainSession.state_dict()
    meta: dict           # what the run loop stored (data position, metrics, ...)


def save_checkpoint(folder: str | os.PathLike, step: int, state: dict,
                    meta: dict | None = None) -> Path:
    """Write `folder/step-<step>` atomically; returns its path. Raises CheckpointError."""
    folder = Path(folder)
    final = folder / f"step-{step}"
    tmp = folder / f".tmp-step-{step}-{os.getpid()}"
    arrays, rest = _flatten(state)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        with open(tmp / "arrays.npz", "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        with open(tmp / "meta.json", "w") as f:
            json.dump({"step": step, "state": rest, "meta": meta or {}}, f)
            f.flush()
            os.fsync(f.fileno())
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


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    path = Path(path)
    try:
        with open(path / "meta.json") as f:
            meta = json.load(f)
        with np.load(path / "arrays.npz") as npz:
            arrays = {k: npz[k] for k in npz.files}
        return Checkpoint(path, int(meta["step"]), _unflatten(meta["state"], arrays),
                          meta.get("meta", {}))
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise CheckpointError(f"Checkpoint {path} is unreadable: {e}.",
                              "Resume from an earlier checkpoint or restart the run.") from e


def list_checkpoints(folder: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders are not checkpoints)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit():
            found.append((int(p.name[5:]), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    found = list_checkpoints(folder)
    return found[-1] if found else None


def prune_checkpoints(folder: str | os.PathLike, keep_last: int, keep: tuple[int, ...] = ()) -> None:
    """Delete all but the newest `keep_last` checkpoints and the steps in `keep` (the best),
    and any temporary folders left by a crash."""
    folder = Path(folder)
    found = list_checkpoints(folder)
    doomed = found[:-keep_last] if keep_last > 0 else found
    for p in doomed:
        if int(p.name[5:]) not in keep:
            shutil.rmtree(p, ignore_errors=True)
    if folder.is_dir():
        for p in folder.glob(".tmp-step-*"):
            shutil.rmtree(p, ignore_errors=True)
