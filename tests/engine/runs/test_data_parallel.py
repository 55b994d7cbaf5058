"""Data-parallel runs on Ray (app.engine.runs.data_parallel): the runner on the loopback Ray
head against one process on the whole step, pause and resume, and the errors without Ray or
for GRPO. Why 1e-5 relative holds, and how the differences are measured: the docstring of
tests/engine/training/test_communicator.py (the same comparison with threads as ranks)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from app.engine import load_model
from app.engine.data.dataset import load_dataset
from app.engine.errors import ConfigError, DatasetError
from app.engine.runs.data_parallel import run_data_parallel
from app.engine.runs.rundir import RunDir
from app.engine.training.checkpoints import list_checkpoints
from app.engine.training.sft import train
from tests.engine.training.test_communicator import (RTOL, max_relative_differences,
                                                     run_config, write_data)


class Control:
    """The runner's side of a worker's JobControl: events kept, one standing request (a pause
    asked before the first step is heard after it: rank 0 asks between steps)."""

    def __init__(self, request: str | None = None):
        self.events: list[dict] = []
        self.request = request

    def report(self, event: dict) -> dict:
        self.events.append(event)
        return event

    def should_stop(self) -> str | None:
        return self.request


def make_run(tmp_path, name: str, workers: int, model: str = "mixtral-q8_0.gguf") -> RunDir:
    config = run_config(model, write_data(tmp_path / "data.jsonl"), workers)
    return RunDir.create(tmp_path / name, {"kind": "sft", **config.to_dict()})


def first_step_routing(config) -> list[dict]:
    """What each of 2 ranks routes at step 1, MoE layer -> slots per expert (E,): the base
    model's routing, since a fresh adapter's B is zero (the run routes exactly so)."""
    model = load_model(config.model)
    dataset = load_dataset(config.data, model.tokenizer, config.data_config)
    micro = next(dataset.train_batches(0, config.train.grad_accum * config.workers))
    params, shares = model.params(None), []
    for rank in range(2):
        routing: dict = {}
        for b in micro[rank::2]:
            _, stats = model.loss(params, b.tokens, b.labels, b.token_weights, b.positions,
                                  b.segments)
            for layer, counts in stats["routing"].items():
                routing[layer] = routing.get(layer, 0) + counts
        shares.append(routing)
    return shares


def test_without_ray_workers_fail_with_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)          # `import ray` raises ImportError
    with pytest.raises(ConfigError, match="needs Ray") as e:
        run_data_parallel(make_run(tmp_path, "run", 2, "llama-q8_0.gguf"), Control())
    assert "pip install" in e.value.hint and "ray" in e.value.hint


def test_grpo_runs_do_not_train_data_parallel(tmp_path):
    run = RunDir.create(tmp_path / "grpo", {"kind": "grpo", "model": "m.gguf",
                                            "prompts": "p.jsonl"})
    with pytest.raises(ConfigError, match="Only supervised") as e:
        run_data_parallel(run, Control())
    assert "workers to 1" in e.value.hint


@pytest.fixture(scope="module")
def ray_driver(ray_head):
    """This process joined to the loopback head (as the worker process joins a cluster), once
    for the module's Ray tests (joining takes seconds)."""
    import ray
    import ray._private.ray_constants
    from ray._private.authentication_test_utils import reset_auth_token_state

    with pytest.MonkeyPatch.context() as patch:
        for key, value in ray_head.env().items():
            patch.setenv(key, value)
        # ray.init replaces a 127.0.0.1 address by this machine's outward IP, where the loopback
        # head does not listen; with "clusters" off (Ray's switch for macOS/Windows) it keeps it.
        patch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
        reset_auth_token_state()     # Ray read RAY_AUTH_MODE when it was imported: read it again
        ray.init(address=ray_head.gcs_address, log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()
    reset_auth_token_state()


@pytest.mark.slow
def test_two_ray_workers_equal_one_process_and_resume_after_a_pause(tmp_path, ray_driver):
    one = make_run(tmp_path, "one", 1)
    one_events: list[dict] = []
    config = run_config("mixtral-q8_0.gguf", tmp_path / "data.jsonl", 1)
    assert train(config, one_events.append, lambda: None, one.checkpoints_dir) == "done"
    dp = make_run(tmp_path, "dp", 2)
    rank0, rank1 = first_step_routing(run_config("mixtral-q8_0.gguf", tmp_path / "data.jsonl", 2))
    assert any(np.abs(rank0[il] / rank0[il].sum() - rank1[il] / rank1[il].sum()).max() > 0.1
               for il in rank0), "the ranks route their tokens to different experts"
    first = Control("pause")
    assert run_data_parallel(dp, first) == "paused"
    assert [e["step"] for e in first.events if e["type"] == "step"] == [1]
    assert list_checkpoints(dp.checkpoints_dir), "rank 0 saved the paused state"
    second = Control()
    assert run_data_parallel(dp, second) == "done"
    assert any(e["type"] == "log" and "resumed from step" in e["message"] for e in second.events)
    dp_events = [e for e in first.events + second.events if e["type"] != "start"]
    loss_rel, tensor_rel = max_relative_differences(dp_events, dp.checkpoints_dir, one_events,
                                                    one.checkpoints_dir)
    print(f"MEASURED on Ray: losses {loss_rel:.2e}, tensors {tensor_rel:.2e}")
    assert loss_rel < RTOL and tensor_rel < RTOL
    assert (dp.path / "adapter.gguf").exists()


@pytest.mark.slow
def test_a_ranks_engine_error_is_the_runs_error(tmp_path, ray_driver):
    run = make_run(tmp_path, "dp", 2, "llama-q8_0.gguf")
    (tmp_path / "data.jsonl").unlink()
    with pytest.raises(DatasetError, match="data.jsonl"):
        run_data_parallel(run, Control())
