"""Executors: where a queued job runs. The queue and the worker stay on this machine; an
executor runs one attempt of a job somewhere and answers for it by its *handle* (JSON, stored
on the job):

- `check()` -> a line saying what it is ("Ray 2.60.0, 2 CPUs, 0 GPUs"), or a ClusterError
  (`probe_cluster` goes further: a small job that imports the workbench there; `cluster_test`
  gives both answers, for `workbench cluster test` and Settings' Test connection);
- `submit(job, run_dir)` -> the handle of attempt `job.attempt`;
- `poll(handle)` -> `Poll(state, message)`, state one of POLL_STATES;
- `cancel(handle)`: stop it (the run saves a checkpoint within the stop grace and exits);
- `logs(handle)` -> its output so far.

`local` (`LocalExecutor`) is this machine's worker running the job in its own process (the
handle is the worker's pid and start time); a cluster's is `RayExecutor` (the Ray Jobs REST
API). `executor_for(job, queue)` picks one. May import: runs.queue, runs.clusters, runs.rundir,
runtime, errors.
"""

from __future__ import annotations

from app.engine.runs.executors.base import ENDED, POLL_STATES, Executor, Poll
from app.engine.runs.executors.local import LocalExecutor
from app.engine.runs.executors.ray import (DEFAULT_STOP_GRACE_S, AlreadySubmitted, RayExecutor,
                                           Unreachable, check_cluster, cluster_resources,
                                           cluster_test, probe_cluster)

__all__ = ["ENDED", "POLL_STATES", "AlreadySubmitted", "Executor", "LocalExecutor", "Poll",
           "RayExecutor", "Unreachable", "check_cluster", "cluster_resources", "cluster_test",
           "executor_for", "probe_cluster"]


def executor_for(job, queue, *, stop_grace_s: float = DEFAULT_STOP_GRACE_S) -> Executor:
    """The executor of `job` of `queue` (a JobQueue): LocalExecutor, or the RayExecutor of the
    cluster it names among the queue's clusters (its token from the keyring or the
    environment; a stopped job's grace `stop_grace_s`)."""
    if job.is_local:
        return LocalExecutor(queue.path)
    store = queue.clusters()
    return RayExecutor(store.get(job.executor), store.token(job.executor),
                       queue_id=queue.queue_id, stop_grace_s=stop_grace_s)
