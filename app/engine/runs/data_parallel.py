"""Data-parallel runs on Ray: `run_data_parallel(run_dir, control)` trains a supervised run
with `workers: N` as N Ray Train workers (a `DataParallelTrainer`, no torch needed).

The runner has the worker's runner signature (app.engine.runs.worker): it joins the Ray
cluster of RAY_ADDRESS (or the one `ray.init` already joined in this process; with neither, it
starts a local one) and runs `app.engine.training.sft.train` on every worker with a
`HostCommunicator` whose meeting point is a threaded Ray actor (a `Rendezvous`), or with NCCL
over it when the run trains on GPUs. Each step's windows are sharded by rank; gradients x
tokens, losses and counts are summed over the ranks before the division by the global token
count (app.engine.training.session).

Rank 0 alone reads and writes the run directory (checkpoints, the final adapter) and resumes
from its last checkpoint; the other ranks start from rank 0's state. Ray Train keeps its own
bookkeeping in the run's `ray/` folder (storage every node of a cluster sees). Rank 0's events
travel through a small actor (the hub) to this process, which records them with
`control.report`; the runner polls `control.should_stop()` and leaves the request at the hub,
where rank 0 reads it between steps and tells the other ranks (every rank stops after the same
step). If this runner is interrupted, it kills the two actors: the workers' next collective
fails and Ray Train ends them.

Ray is optional (`pip install "ray[default,train]==2.60.0"`): without it a run with workers > 1
fails with a ConfigError that says so. GRPO runs do not train data-parallel.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import app
from app.engine.errors import ConfigError, EngineError
from app.engine.training import events
from app.engine.training.communicator import HostCommunicator, NcclCommunicator, Rendezvous
from app.engine.training.sft import KIND as SFT_KIND
from app.engine.training.sft import RunConfig, train

POLL_S = 0.2          # how often the runner forwards events and stop requests
STOP_WAIT_S = 60.0    # how long an interrupted runner waits for Ray Train to end its workers
RAY_INSTALL = 'pip install "ray[default,train]==2.60.0"'


class Hub:
    """Between this runner and rank 0 (a Ray actor): rank 0's events on their way to the run's
    reporter, the stop request the runner leaves for rank 0, and how the run ended."""

    def __init__(self):
        self.events: list[dict] = []
        self.request: str | None = None
        self.outcome: str | None = None
        self.error: EngineError | None = None

    def post(self, event: dict) -> None:
        self.events.append(event)

    def take(self) -> tuple[list[dict], str | None, EngineError | None]:
        """(the events since the last take, the outcome, the first rank's EngineError)."""
        taken, self.events = self.events, []
        return taken, self.outcome, self.error

    def ask(self, request: str) -> None:
        self.request = request

    def requested(self) -> str | None:
        return self.request

    def finish(self, outcome: str) -> None:
        self.outcome = outcome

    def fail(self, error: EngineError) -> None:
        self.error = self.error or error


def import_ray():
    """(ray, ray.train, DataParallelTrainer); a ConfigError naming the install command when Ray
    is not installed."""
    try:
        import ray
        import ray.train
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer   # Ray Train V2
    except ImportError as e:
        raise ConfigError(f"Data-parallel training (workers > 1) needs Ray, which is not "
                          f"installed here ({e}).",
                          f"Install it ({RAY_INSTALL}), or set workers to 1.") from None
    return ray, ray.train, DataParallelTrainer


def read_config(run_dir) -> RunConfig:
    """The run's RunConfig; a GRPO run (or any kind but supervised) is a ConfigError."""
    raw = dict(run_dir.config())
    kind = raw.pop("kind", SFT_KIND)
    if kind != SFT_KIND:
        raise ConfigError(f"Only supervised (SFT) runs train data-parallel; this run is {kind}.",
                          "Set workers to 1 (GRPO runs on one worker).")
    config = RunConfig.from_dict(raw)
    config.validate()
    return config


def worker_env() -> dict:
    """The runtime environment of the actors and workers: this checkout of the app importable."""
    root = str(Path(app.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": {"PYTHONPATH": path}}


def rank_main(loop_config: dict) -> None:
    """One rank (`train_loop_per_worker`): the supervised loop on this rank's shard."""
    import ray
    import ray.train

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    hub, meeting = loop_config["hub"], loop_config["rendezvous"]
    config = RunConfig.from_dict(loop_config["config"])
    comm = HostCommunicator(rank, world, lambda round_, payload, root: ray.get(
        meeting.meet.remote(rank, round_, payload, root)))
    if config.train.device == "cuda":
        comm = NcclCommunicator(comm)
    try:    # rank 0's report and should_stop go through the hub (train ignores the others')
        outcome = train(config, lambda event: ray.get(hub.post.remote(event)),
                        lambda: ray.get(hub.requested.remote()), loop_config["checkpoints"], comm)
    except EngineError as e:
        ray.get(hub.fail.remote(e))
        raise
    if rank == 0:
        ray.get(hub.finish.remote(outcome))


def fit(trainer, fitted: dict) -> None:
    """trainer.fit(), its exception kept in fitted["error"] (the runner's thread raises it)."""
    try:
        trainer.fit()
    except Exception as e:
        fitted["error"] = e


def run_data_parallel(run_dir, control) -> str | None:
    """The worker's runner for a supervised run with `workers` N: N Ray Train workers (see the
    module's docstring). Returns "done", "paused" or "cancelled"; raises rank 0's EngineError."""
    config = read_config(run_dir)
    ray, ray_train, DataParallelTrainer = import_ray()
    env = worker_env()
    joined_here = not ray.is_initialized()
    if joined_here:
        try:
            ray.init(runtime_env=env)          # RAY_ADDRESS, else a local cluster
        except ConnectionError as e:
            raise ConfigError(f"Could not join the Ray cluster at "
                              f"{os.environ.get('RAY_ADDRESS', '(none)')}: {e}.",
                              "Check that the cluster runs, and RAY_ADDRESS and its token "
                              "(RAY_AUTH_TOKEN).") from None
    hub = ray.remote(num_cpus=0)(Hub).options(runtime_env=env).remote()
    meeting = ray.remote(num_cpus=0, max_concurrency=config.workers + 1)(Rendezvous).options(
        runtime_env=env).remote(config.workers)
    fitted: dict[str, Any] = {}
    thread = None
    try:
        trainer = DataParallelTrainer(
            rank_main,
            train_loop_config={"config": config.to_dict(), "hub": hub, "rendezvous": meeting,
                               "checkpoints": str(run_dir.checkpoints_dir)},
            scaling_config=ray_train.ScalingConfig(num_workers=config.workers,
                                                   use_gpu=config.train.device == "cuda"),
            run_config=ray_train.RunConfig(name="train", storage_path=str(run_dir.path / "ray"),
                                           worker_runtime_env=env))
        thread = threading.Thread(target=fit, args=(trainer, fitted), name="ray-train-fit",
                                  daemon=True)
        thread.start()
        control.report(events.LOG_EVENT(message=f"training data-parallel on {config.workers} "
                                                "Ray workers"))
        while True:
            alive = thread.is_alive()
            taken, outcome, error = ray.get(hub.take.remote())
            for event in taken:
                control.report(event)
            if not alive:
                break
            request = control.should_stop()
            if request:
                hub.ask.remote(request)
            thread.join(POLL_S)
    finally:
        for actor in (meeting, hub):    # an interrupted run: the workers' next call fails
            ray.kill(actor)
        if thread is not None:
            thread.join(STOP_WAIT_S)
        if joined_here:
            ray.shutdown()
    if error is not None:
        raise error
    if outcome is None:
        raise fitted.get("error") or RuntimeError("Ray Train ended without rank 0's outcome.")
    return outcome
