"""Communicators: how the ranks of a data-parallel run combine what each computed.

A `Communicator` knows its `rank` and `world_size` and offers three collectives, which every
rank calls in the same order:

- `allreduce_sum(values)`: `values` is an array, a Python number, or a dict/list/tuple of them
  (nested; the same structure, shapes and dtypes on every rank); every rank gets the elementwise
  sum over the ranks, in the same structure, arrays on the device they came from, as new arrays
  (the caller may change them in place). Sums are taken in rank order, so every rank gets the
  same bits.
- `broadcast(value, root=0)`: any picklable value of rank `root`, to every rank.
- `barrier()`: returns when every rank has called it.

Implementations: `SingleProcess` (rank 0 of 1: every collective is the identity, at no cost),
`HostCommunicator` (through a meeting point in host memory: a `Rendezvous` shared by threads in
one process, or the Ray actor of app.engine.runs.data_parallel) and `NcclCommunicator` (CuPy's
NCCL for device arrays, bootstrapped by a host communicator).
"""

from __future__ import annotations

import copy
import importlib
import threading
from typing import Any, Callable

import numpy as np

from app.engine.errors import ConfigError
from app.engine.runtime.backend import get_array_module, to_host


class Communicator:
    """The collectives of one rank (see the module's docstring)."""

    rank: int = 0
    world_size: int = 1

    def allreduce_sum(self, values):
        raise NotImplementedError

    def broadcast(self, value: Any, root: int = 0) -> Any:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError


class SingleProcess(Communicator):
    """The one rank of a run without data parallelism."""

    def allreduce_sum(self, values):
        return values

    def broadcast(self, value: Any, root: int = 0) -> Any:
        return value

    def barrier(self) -> None:
        return None


# ------------------------------------------------------------------------ value trees


def flatten(values) -> tuple[list, Callable[[list], Any]]:
    """(leaves, rebuild): the arrays and numbers of a dict/list/tuple tree in a fixed order,
    and the function that builds the same tree from a list of new leaves."""
    if isinstance(values, dict):
        keys, parts = list(values), [flatten(v) for v in values.values()]
    elif isinstance(values, (list, tuple)):
        keys, parts = None, [flatten(v) for v in values]
    else:
        return [values], lambda leaves: leaves[0]
    sizes = [len(leaves) for leaves, _ in parts]
    kind = type(values)

    def rebuild(leaves: list):
        out, i = [], 0
        for size, (_, build) in zip(sizes, parts):
            out.append(build(leaves[i:i + size]))
            i += size
        return dict(zip(keys, out)) if keys is not None else kind(out)
    return [leaf for leaves, _ in parts for leaf in leaves], rebuild


def sum_in_rank_order(parts: list) -> Any:
    """The elementwise sum of the ranks' trees `parts` (host arrays and numbers), rank 0 first:
    ((p0 + p1) + p2) + ..., in each array's own dtype."""
    (first, rebuild), *rest = [flatten(p) for p in parts]
    total = [np.array(x) if isinstance(x, np.ndarray) else x for x in first]   # copies
    for leaves, _ in rest:
        for i, x in enumerate(leaves):
            if isinstance(total[i], np.ndarray):
                np.add(total[i], x, out=total[i])
            else:
                total[i] = total[i] + x
    return rebuild(total)


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


# ------------------------------------------------------------------------ through the host


class Rendezvous:
    """Where the ranks of one run meet, in host memory (thread-safe). `meet(rank, round_,
    payload, root)` waits until every rank has brought its payload for `round_` and returns
    the rank-order sum of the payloads (root None) or the payload of rank `root`. The Ray
    communicator runs one as a threaded actor; in-process tests share one between threads."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._cond = threading.Condition()
        self._rounds: dict[int, dict] = {}   # round -> {"parts": {rank: payload}, "result",
        #                                       "taken": how many ranks took the result}

    def meet(self, rank: int, round_: int, payload: Any, root: int | None = None) -> Any:
        with self._cond:
            meeting = self._rounds.setdefault(round_, {"parts": {}, "taken": 0})
            meeting["parts"][rank] = payload
            if len(meeting["parts"]) == self.world_size:
                parts = [meeting["parts"][r] for r in range(self.world_size)]
                meeting["result"] = sum_in_rank_order(parts) if root is None else parts[root]
                self._cond.notify_all()
            self._cond.wait_for(lambda: "result" in meeting)
            meeting["taken"] += 1
            if meeting["taken"] == self.world_size:
                del self._rounds[round_]
            return meeting["result"]


class HostCommunicator(Communicator):
    """Collectives through a meeting point on the host: `meet(round_, payload, root)` behaves as
    `Rendezvous.meet` for this rank (a bound method of a shared Rendezvous, or a call to the Ray
    actor that holds one). Device arrays go to the host and come back to the device."""

    def __init__(self, rank: int, world_size: int, meet: Callable[[int, Any, int | None], Any]):
        self.rank, self.world_size = rank, world_size
        self._meet = meet
        self._round = 0

    def _next(self, payload: Any, root: int | None) -> Any:
        self._round += 1
        return self._meet(self._round, payload, root)

    def allreduce_sum(self, values):
        leaves, rebuild = flatten(values)
        total, _ = flatten(self._next([to_host(x) if _is_array(x) else x for x in leaves], None))
        # copies: a result shared between threads, or read-only from Ray's object store
        return rebuild([get_array_module(x).array(t) if _is_array(x) else t
                        for x, t in zip(leaves, total)])

    def broadcast(self, value: Any, root: int = 0) -> Any:
        # a copy of its own, as from Ray: threads of one process would share the root's objects
        return copy.deepcopy(self._next(value if self.rank == root else None, root))

    def barrier(self) -> None:
        self._next(None, 0)


def thread_communicators(world_size: int) -> list[HostCommunicator]:
    """One communicator per rank for `world_size` threads of this process."""
    meeting = Rendezvous(world_size)
    return [HostCommunicator(rank, world_size,
                             lambda round_, payload, root, rank=rank:
                             meeting.meet(rank, round_, payload, root))
            for rank in range(world_size)]


# ------------------------------------------------------------------------ NCCL (GPUs)

_NCCL_TYPES = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
               "int32": "NCCL_INT32", "int64": "NCCL_INT64"}


def _import_nccl():
    try:
        return importlib.import_module("cupy.cuda.nccl")
    except Exception as e:   # ImportError, or a CuPy built without NCCL
        raise ConfigError(f"NCCL is not usable through CuPy here ({e}).",
                          "Install CuPy with NCCL on the GPU workers (pip install -e '.[gpu]'), "
                          "or train on the CPU (device cpu).") from None


class NcclCommunicator(Communicator):
    """allreduce_sum of device arrays through NCCL (one in-place all-reduce per dtype over the
    arrays packed into one buffer; the numbers and host arrays packed into one float64 device
    buffer); broadcast and barrier through `bootstrap`, which also carries NCCL's unique id from
    rank 0. `nccl` is CuPy's `cupy.cuda.nccl` (the tests pass a stand-in)."""

    def __init__(self, bootstrap: Communicator, nccl=None):
        self.nccl = nccl if nccl is not None else _import_nccl()
        self.bootstrap = bootstrap
        self.rank, self.world_size = bootstrap.rank, bootstrap.world_size
        uid = bootstrap.broadcast(self.nccl.get_unique_id() if self.rank == 0 else None)
        self._comm = self.nccl.NcclCommunicator(self.world_size, uid, self.rank)

    def _allreduce(self, buffer) -> None:
        """Sum a contiguous 1-D device buffer over the ranks, in place."""
        xp = get_array_module(buffer)
        kind = getattr(self.nccl, _NCCL_TYPES[buffer.dtype.name])
        self._comm.allReduce(buffer.data.ptr, buffer.data.ptr, buffer.size, kind,
                             self.nccl.NCCL_SUM, xp.cuda.get_current_stream().ptr)

    def allreduce_sum(self, values):
        leaves, rebuild = flatten(values)
        on_device = [i for i, x in enumerate(leaves)
                     if _is_array(x) and get_array_module(x) is not np]
        if not on_device:
            return self.bootstrap.allreduce_sum(values)
        xp, out = get_array_module(leaves[on_device[0]]), list(leaves)
        for dtype in dict.fromkeys(leaves[i].dtype for i in on_device):
            group = [i for i in on_device if leaves[i].dtype == dtype]
            buffer = xp.concatenate([leaves[i].ravel() for i in group])   # (sum of sizes,)
            self._allreduce(buffer)
            offset = 0
            for i in group:
                out[i] = buffer[offset:offset + leaves[i].size].reshape(leaves[i].shape)
                offset += leaves[i].size
        on_host = sorted(set(range(len(leaves))) - set(on_device))
        if on_host:
            host = [np.asarray(leaves[i], dtype=np.float64).ravel() for i in on_host]
            buffer = xp.asarray(np.concatenate(host))          # (sum of sizes,) float64
            self._allreduce(buffer)
            summed, offset = to_host(buffer), 0
            for i, h in zip(on_host, host):
                part = summed[offset:offset + h.size]
                x = leaves[i]
                out[i] = (part.reshape(x.shape).astype(x.dtype) if isinstance(x, np.ndarray)
                          else type(x)(part[0]))
                offset += h.size
        return rebuild(out)

    def broadcast(self, value: Any, root: int = 0) -> Any:
        return self.bootstrap.broadcast(value, root)

    def barrier(self) -> None:
        self.bootstrap.barrier()
