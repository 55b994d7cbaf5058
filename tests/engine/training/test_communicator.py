"""Communicators and data-parallel training in one process (threads as ranks).

The acceptance test: 2 ranks on shards of each step's micro-batches for K steps equal one
process on the whole step, to 1e-5 relative, for a dense model and for a MoE whose ranks route
their tokens to different experts. Why 1e-5 and not bit-identity: one process sums the step's
gradients x tokens over its micro-batches in order, ((g0 n0 + g1 n1) + g2 n2) + g3 n3, and two
ranks sum (g0 n0 + g2 n2) + (g1 n1 + g3 n3) (rank 0 takes micro-batches 0 and 2). Each float32
addition rounds to within 2^-24 (6e-8) relative to its result, so the two gradients differ by a
few 1e-7 of their magnitude, and so do the losses (float64 sums of the same products: ~1e-9).
AdamW then divides each element by its own sqrt(v): an element whose terms nearly cancel has a
rounding error large relative to itself, and that error becomes a share of a full-size update.
So single elements of the trained tensors may differ by ~1e-5 of the tensor's largest value
after a few steps (measured up to 1.9e-5 on the MoE), while each tensor as a whole moves by
~1e-6 of its norm: the test compares tensors by ||a - b|| / ||b|| (measured: 8e-7 dense, 1.1e-6
MoE, after K = 3 steps) and losses by |a - b| / |b|. Anything structurally wrong (a rank's share
counted twice, a gradient normalised by the local instead of the global token count, a dropout
mask drawn from a local index) is off by 1e-2 or more.
"""

from __future__ import annotations

import ctypes
import json
import threading
import types

import numpy as np
import pytest

from app.engine import load_model
from app.engine.data.batches import Batch
from app.engine.data.dataset import DataConfig
from app.engine.errors import ConfigError
from app.engine.training.checkpoints import list_checkpoints, load_checkpoint
from app.engine.training.communicator import (HostCommunicator, NcclCommunicator,
                                              SingleProcess, thread_communicators)
from app.engine.training.config import TrainConfig
from app.engine.training.session import TrainSession
from app.engine.training.sft import RunConfig, train
from tests import fake_cupy
from tests.conftest import GOLDEN

K_STEPS = 3
RTOL = 1e-5


def in_threads(fn, n: int) -> list:
    """fn(rank) in n threads; their results in rank order (the first exception re-raised)."""
    results, errors = [None] * n, []

    def run(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as e:   # noqa: B902 - carried to the test's thread
            errors.append(e)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


# ------------------------------------------------------------------------ the collectives


def test_single_process_collectives_are_the_identity():
    comm = SingleProcess()
    values = {"g": np.ones(3, np.float32), "n": 4}
    assert (comm.rank, comm.world_size) == (0, 1)
    assert comm.allreduce_sum(values) is values and comm.broadcast("x") == "x"
    comm.barrier()


def test_thread_communicators_sum_in_rank_order_and_broadcast():
    comms = thread_communicators(3)

    def rank_work(rank):
        comm = comms[rank]
        total = comm.allreduce_sum({"g": np.full((2, 2), rank + 1, np.float32),   # (2, 2)
                                    "parts": [rank, float(rank) / 2], "t": (np.arange(3),)})
        total["g"] += 1          # a copy of its own: the other ranks do not see it
        comm.barrier()
        return total, comm.broadcast(f"from {rank}", root=1), comm.broadcast(np.arange(2) + rank)
    results = in_threads(rank_work, 3)
    for total, said, state in results:
        np.testing.assert_array_equal(total["g"], np.full((2, 2), 7, np.float32))
        assert total["parts"] == [3, 1.5] and isinstance(total["parts"][0], int)
        np.testing.assert_array_equal(total["t"][0], [0, 3, 6])
        assert said == "from 1"
        np.testing.assert_array_equal(state, [0, 1])
    assert len({id(state) for _, _, state in results}) == 3, "each rank gets its own copy"


class FakeNccl(types.SimpleNamespace):
    """cupy.cuda.nccl for threads of this process: communicators of one unique id meet at a
    barrier; allReduce reads and writes the buffers through their pointers, as NCCL does."""

    NCCL_SUM = 0
    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_INT32, NCCL_INT64 = (
        np.float16, np.float32, np.float64, np.int32, np.int64)

    def __init__(self):
        super().__init__(groups={}, calls=[])

    def get_unique_id(self):
        return (len(self.groups) + 1,)

    def NcclCommunicator(self, world_size, uid, rank):   # noqa: N802 - CuPy's name
        nccl = self
        group = self.groups.setdefault(uid, {"barrier": threading.Barrier(world_size),
                                             "views": [None] * world_size})

        class Comm:
            def allReduce(self, send, recv, count, dtype, op, stream):   # noqa: N802
                nccl.calls.append((rank, count, np.dtype(dtype).name))
                ctype = np.ctypeslib.as_ctypes_type(np.dtype(dtype))
                group["views"][rank] = np.ctypeslib.as_array(
                    ctypes.cast(send, ctypes.POINTER(ctype)), (count,))
                group["barrier"].wait()
                total = group["views"][0].copy()
                for view in group["views"][1:]:
                    total += view
                group["barrier"].wait()          # every rank has read before anyone writes
                np.ctypeslib.as_array(ctypes.cast(recv, ctypes.POINTER(ctype)), (count,))[:] = total
                group["barrier"].wait()
        return Comm()


@pytest.fixture
def fake_gpu(monkeypatch):
    """The CuPy stand-in plus what NCCL needs of it: device pointers (`.data.ptr`, here the host
    address) and the current stream."""
    fake_cupy.install(monkeypatch)
    monkeypatch.setattr(fake_cupy.DeviceArray, "data",
                        property(lambda a: types.SimpleNamespace(ptr=a.ctypes.data)), raising=False)
    monkeypatch.setattr(fake_cupy.module.cuda, "get_current_stream",
                        lambda: types.SimpleNamespace(ptr=0), raising=False)
    return FakeNccl()


def test_nccl_communicator_reduces_device_arrays_in_one_call_per_dtype(fake_gpu):
    comms = thread_communicators(2)
    xp = fake_cupy.module

    def rank_work(rank):
        comm = NcclCommunicator(comms[rank], nccl=fake_gpu)
        values = {"a": xp.asarray(np.full((2, 3), rank + 1, np.float32)),       # (2, 3)
                  "b": xp.asarray(np.arange(4, dtype=np.float32) * (rank + 1)),  # (4,)
                  "tokens": 10 + rank, "loss": 0.5, "routing": np.array([rank, 1])}
        return comm.allreduce_sum(values), comm.broadcast(rank, root=1)
    for total, said in in_threads(rank_work, 2):
        assert isinstance(total["a"], fake_cupy.DeviceArray)
        np.testing.assert_array_equal(fake_cupy.asnumpy(total["a"]), np.full((2, 3), 3.0))
        np.testing.assert_array_equal(fake_cupy.asnumpy(total["b"]), np.arange(4) * 3.0)
        assert total["tokens"] == 21 and isinstance(total["tokens"], int)
        assert total["loss"] == 1.0
        np.testing.assert_array_equal(total["routing"], [1, 2])
        assert said == 1
    # per rank: one float32 buffer (6 + 4 values), one float64 buffer of the host values (4)
    assert sorted(fake_gpu.calls) == [(0, 4, "float64"), (0, 10, "float32"),
                                      (1, 4, "float64"), (1, 10, "float32")]


def test_sessions_on_the_device_step_together_through_nccl(fake_gpu):
    """Two ranks' sessions on the (stand-in) GPU, their gradients summed by NCCL, equal one
    session on the whole step: the same comparison as the run's below, one level down."""
    model = load_model(GOLDEN / "mixtral-q8_0.gguf", device="cuda")
    tokens = np.random.default_rng(3).integers(0, model.config.n_vocab, (4, 24))   # 4 x (T,)
    micro = [Batch(t, np.roll(t, -1)) for t in tokens]
    config = TrainConfig(mode="lora", lora_rank=4, lora_alpha=8, lr=1e-2, max_steps=K_STEPS,
                         lora_targets=("attention", "experts", "router"), device="cuda",
                         precision="fp32")                # a float32 identity (issue 30)
    one = TrainSession(model, config)
    one_losses = [one.step(micro).loss for _ in range(K_STEPS)]
    comms = thread_communicators(2)

    def rank_work(rank):
        session = TrainSession(model, config, communicator=NcclCommunicator(comms[rank],
                                                                            nccl=fake_gpu))
        return [session.step(micro).loss for _ in range(K_STEPS)], session
    (losses, rank0), (_, rank1) = in_threads(rank_work, 2)
    assert losses == pytest.approx(one_losses, rel=RTOL)
    for name, a in one.trainable.items():
        expected, got = fake_cupy.asnumpy(a), fake_cupy.asnumpy(rank0.trainable[name])
        assert np.linalg.norm(got - expected) <= RTOL * np.linalg.norm(expected), name
        np.testing.assert_array_equal(fake_cupy.asnumpy(rank1.trainable[name]), got,
                                      err_msg="every rank makes the same update")
    # each rank and step: the float32 gradients in one call, the host numbers in another
    assert len(fake_gpu.calls) == 2 * 2 * K_STEPS


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_rank_without_micro_batches_adds_nothing(fake_gpu, device):
    """Steps of 4, 1 and 3 micro-batches (an epoch's short last step: rank 1 gets none, or one
    fewer than rank 0) on two ranks equal one session, through the host and through NCCL."""
    model = load_model(GOLDEN / "llama-q8_0.gguf", device=device)
    tokens = np.random.default_rng(4).integers(0, model.config.n_vocab, (8, 16))   # 8 x (T,)
    micro = [Batch(t, np.roll(t, -1)) for t in tokens]
    steps = [micro[:4], micro[4:5], micro[5:]]
    config = TrainConfig(mode="lora", lora_rank=4, lora_alpha=8, lr=1e-2, device=device,
                         lora_targets=("attention", "ffn"), max_steps=len(steps),
                         precision="fp32")                # a float32 identity (issue 30)
    one = TrainSession(model, config)
    one_losses = [one.step(step).loss for step in steps]
    comms = thread_communicators(2)

    def rank_work(rank):
        comm = NcclCommunicator(comms[rank], nccl=fake_gpu) if device == "cuda" else comms[rank]
        session = TrainSession(model, config, communicator=comm)
        return [session.step(step).loss for step in steps], session
    (losses, rank0), _ = in_threads(rank_work, 2)
    assert losses == pytest.approx(one_losses, rel=RTOL)
    for name, a in one.trainable.items():
        expected, got = fake_cupy.asnumpy(a), fake_cupy.asnumpy(rank0.trainable[name])
        assert np.linalg.norm(got - expected) <= RTOL * np.linalg.norm(expected), name


def test_nccl_without_cupy_is_a_clear_error():
    with pytest.raises(ConfigError, match="NCCL") as e:
        NcclCommunicator(SingleProcess())
    assert "gpu" in e.value.hint


# ------------------------------------------------------------- data parallel = one process


def write_data(path):
    """Two kinds of rows (prose and digits), so that the step's windows route differently."""
    rows = [{"text": f"Expert {i % 4} routes token {i}; the router learns."} if i % 2 else
            {"text": " ".join(str(i * 7919 + j) for j in range(12))} for i in range(60)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def run_config(model: str, data, workers: int) -> RunConfig:
    """K_STEPS steps of 4 windows: 4 micro-batches in one process, 2 per rank with 2 workers."""
    tc = TrainConfig(mode="lora", lr=1e-2, lora_rank=4, lora_alpha=8, lora_dropout=0.1,
                     lora_targets=("attention", "experts", "router", "ffn"),
                     grad_accum=4 // workers, schedule="constant",
                     precision="fp32")    # float32: bf16's rounding turns the ranks' other
                                          # summation order into larger steps (issue 30)
    return RunConfig(model=str(GOLDEN / model), data=str(data), train=tc,
                     data_config=DataConfig(context=32, val_fraction=0.1), epochs=0,
                     max_steps=K_STEPS, eval_every=2, norms_every=1, workers=workers)


def final_state(checkpoints) -> dict:
    return load_checkpoint(list_checkpoints(checkpoints)[-1]).state["trainable"]


def max_relative_differences(dp_events, dp_ckpt, one_events, one_ckpt) -> tuple[float, float]:
    """(losses, trained tensors): the largest |a - b| / |b| over the step losses, and the
    largest ||a - b|| / ||b|| over the trained tensors (see the module's docstring)."""
    losses = [[e["loss"] for e in events if e["type"] == "step"] for events in (dp_events,
                                                                                 one_events)]
    assert len(losses[0]) == len(losses[1]) == K_STEPS
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(*losses))
    dp, one = final_state(dp_ckpt), final_state(one_ckpt)
    assert set(dp) == set(one)
    tensor_rel = max(float(np.linalg.norm(dp[n] - one[n]) / np.linalg.norm(one[n])) for n in one)
    return loss_rel, tensor_rel


class RoutingRecorder(HostCommunicator):
    """A thread communicator that keeps what its rank sends of each step's MoE routing."""

    def __init__(self, comm: HostCommunicator):
        super().__init__(comm.rank, comm.world_size, comm._meet)
        self.routing = []

    def allreduce_sum(self, values):
        if isinstance(values, dict) and "routing" in values:
            self.routing.append({il: c.copy() for il, c in values["routing"].items()})
        return super().allreduce_sum(values)


def ranks_route_differently(recorders) -> bool:
    """Some step and MoE layer where the two ranks sent their tokens to different experts (the
    share of each expert differs by more than 10% of the slots)."""
    for step0, step1 in zip(recorders[0].routing, recorders[1].routing):
        for il, counts in step0.items():
            p0, p1 = counts / counts.sum(), step1[il] / step1[il].sum()
            if np.abs(p0 - p1).max() > 0.1:
                return True
    return False


@pytest.mark.parametrize("model", ["llama-q8_0.gguf", "mixtral-q8_0.gguf"])
def test_two_ranks_on_shards_equal_one_process_on_the_whole_step(tmp_path, model):
    data = write_data(tmp_path / "data.jsonl")
    one_events = []
    assert train(run_config(model, data, 1), one_events.append, lambda: None,
                 tmp_path / "one") == "done"
    recorders = [RoutingRecorder(c) for c in thread_communicators(2)]
    rank_events = [[], []]

    def rank_work(rank):
        return train(run_config(model, data, 2), rank_events[rank].append, lambda: None,
                     tmp_path / f"rank{rank}", recorders[rank])
    assert in_threads(rank_work, 2) == ["done", "done"]
    assert not rank_events[1] and not (tmp_path / "rank1").exists(), "rank 0 alone writes"
    loss_rel, tensor_rel = max_relative_differences(rank_events[0], tmp_path / "rank0",
                                                    one_events, tmp_path / "one")
    print(f"MEASURED {model}: losses {loss_rel:.2e}, tensors {tensor_rel:.2e}")
    assert loss_rel < RTOL and tensor_rel < RTOL
    one_evals = [e["loss"] for e in one_events if e["type"] == "eval"]
    dp_evals = [e["loss"] for e in rank_events[0] if e["type"] == "eval"]
    np.testing.assert_allclose(dp_evals, one_evals, rtol=RTOL)
    if "mixtral" in model:
        assert ranks_route_differently(recorders)
        one_routing = [e["layers"] for e in one_events if e["type"] == "routing"]
        dp_routing = [e["layers"] for e in rank_events[0] if e["type"] == "routing"]
        assert dp_routing == one_routing, "rank 0 reports the routing of every rank's tokens"


def test_rank_0_hears_a_cancel_and_every_rank_stops_after_the_same_step(tmp_path):
    data = write_data(tmp_path / "data.jsonl")
    comms, events = thread_communicators(2), [[], []]

    def never_asked():
        raise AssertionError("rank 1 is never asked: rank 0 tells it")
    stop = [lambda: "cancel", never_asked]

    def rank_work(rank):
        return train(run_config("llama-q8_0.gguf", data, 2), events[rank].append, stop[rank],
                     tmp_path / f"rank{rank}", comms[rank])
    assert in_threads(rank_work, 2) == ["cancelled", "cancelled"]
    assert [e["step"] for e in events[0] if e["type"] == "step"] == [1]
    assert [e["tag"] for e in events[0] if e["type"] == "checkpoint"] == ["cancelled"]
    assert not events[1] and not (tmp_path / "rank1").exists()


def test_a_run_with_workers_refuses_to_train_in_one_process(tmp_path):
    config = run_config("llama-q8_0.gguf", write_data(tmp_path / "data.jsonl"), 2)
    with pytest.raises(ConfigError, match="workers 2") as e:
        train(config, lambda event: None, lambda: None)
    assert "Ray cluster" in e.value.hint


def test_workers_is_checked_by_the_schema():
    with pytest.raises(ConfigError, match="workers"):
        RunConfig.from_dict({"model": "m.gguf", "data": "d.jsonl", "workers": 0})
    assert RunConfig.from_dict({"model": "m.gguf", "data": "d.jsonl", "workers": 3}).workers == 3
