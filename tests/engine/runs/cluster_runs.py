"""Helpers of the executor tests: tiny real runs of the sample MoE queued on an executor
("local", or the loopback Ray head of `tests/ray_head.py` added as cluster "loop"), a worker
in a thread, and waiting on the run directory."""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from app.cli.main import run_cli
from app.engine.runs.clusters import Cluster, PathMap, cluster_token_env
from app.engine.runs.queue import FINISHED, JobQueue
from app.engine.runs.rundir import RunDir
from app.engine.runs.worker import run_worker
from tests.conftest import SAMPLE_DATA

TIMEOUT = 90.0  # only waited for in full when something is broken


def train_args(out: Path, steps: int) -> list[str]:
    """A seeded run of `steps` steps of ~0.15 s each, checkpointed every 2 steps."""
    return ["train", "-m", str(SAMPLE_DATA / "tiny-moe.gguf"), "-d", str(SAMPLE_DATA / "chat.jsonl"),
            "--rank", "4", "--alpha", "8", "--targets", "attn", "--lr", "5e-3",
            "--val-split", "0", "--epochs", "0", "--max-steps", str(steps), "--save-every", "2",
            "--ctx", "128", "--batch", "4", "--seed", "0", "-o", str(out)]


def queue_run(q: JobQueue, out: Path, executor: str, steps: int = 40) -> int:
    """`workbench train ... --queue Q --on EXECUTOR`; returns the job id."""
    assert run_cli(train_args(out, steps) + ["--queue", str(q.path), "--on", executor]) == 0
    return q.find(out)[0].id


def reference_adapter(out: Path, steps: int = 40) -> bytes:
    """The adapter of the same run trained straight through, in the foreground."""
    assert run_cli(train_args(out, steps)) == 0
    return (out / "adapter.gguf").read_bytes()


def add_loop_cluster(q: JobQueue, head, monkeypatch, name: str = "loop",
                     token: str | None = "head", path_map: str = "", **kw) -> Cluster:
    """The loopback head as cluster `name`, run with this interpreter (which has the app);
    its token (the head's, unless given) in the environment, as on a machine without keyring."""
    cluster = Cluster(name, head.dashboard_url, PathMap.parse(path_map), python=sys.executable,
                      **kw)
    q.clusters().save(cluster)
    if token is None:
        monkeypatch.delenv(cluster_token_env(name), raising=False)
    else:
        monkeypatch.setenv(cluster_token_env(name), head.token if token == "head" else token)
    return cluster


@contextmanager
def worker(q: JobQueue, **kw):
    """A worker on `q` in a thread (polling fast); stopped (its stop event) on leaving."""
    stop = threading.Event()
    thread = threading.Thread(target=run_worker, args=(q,), daemon=True,
                              kwargs={"poll_s": 0.2, "stop_event": stop, "exclusive": False,
                                      **kw})
    thread.start()
    try:
        yield stop
    finally:
        stop.set()
        thread.join(TIMEOUT)
        assert not thread.is_alive()


def wait_for(cond, what: str, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def wait_finished(q: JobQueue, job_id: int, timeout: float = TIMEOUT):
    return wait_for(lambda: (lambda j: j if j.state in FINISHED + ("paused",) else None)(
        q.get(job_id)), f"job {job_id} to end", timeout)


def last_step(run: RunDir) -> int:
    steps = [e["step"] for e in run.read_metrics(0)[0] if e.get("type") == "step"]
    return steps[-1] if steps else 0


def checkpoint_steps(run: RunDir) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in run.checkpoints_dir.glob("step-*"))
