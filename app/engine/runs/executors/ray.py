"""A Ray cluster as an executor, through the Ray Jobs REST API of its dashboard, with the
standard library's HTTP client only: the machine with the window needs no Ray installed.

One attempt of a job is one Ray job, `submission_id(queue id, job.id, job.attempt)`: Ray refuses
a second job with the same id, so an attempt is never started twice (`AlreadySubmitted`). The
entrypoint runs `<cluster python> -m app queue run-remote <run dir as the cluster sees it>`
(`app.engine.runs.remote`), asking the cluster's `num_cpus`/`num_gpus`; Ray's stop sends it
SIGTERM and waits RAY_JOB_STOP_WAIT_TIME_S (the stop grace) before killing it.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shlex
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import suppress
from urllib.parse import quote

from app.engine.runs.clusters import Cluster, ClusterError
from app.engine.runs.executors.base import Poll

SUBMISSION_ENV = "WORKBENCH_SUBMISSION_ID"  # tells run-remote which attempt it is
DEFAULT_STOP_GRACE_S = 30.0   # how long a stopped run may take to checkpoint and exit
# Every request the worker makes (submit, poll, stop, logs) is given up after HTTP_TIMEOUT_S:
# a head that accepts connections and never answers must not hold the worker, which runs the
# other jobs meanwhile (a job whose head did not answer waits, see worker.ClusterBackoff). A
# submission given up may still have arrived: it is sent again under the same id, which Ray
# refuses (AlreadySubmitted) and the worker then polls, so a slow head costs a retry, not a job.
HTTP_TIMEOUT_S = 5.0
SUBMIT_TIMEOUT_S = 60.0       # `cluster test`'s probe: a head's first job starts its job agent
PROBE_TIMEOUT_S = 120.0       # `cluster test`'s job: started, run and ended within this
_STATES = {"PENDING": "pending", "RUNNING": "running", "SUCCEEDED": "succeeded",
           "FAILED": "failed", "STOPPED": "stopped"}


def submission_id(queue_id: str, job_id: int, attempt: int) -> str:
    """The Ray submission id of a job's attempt: the same id is never submitted twice. The
    queue's id keeps apart the jobs of queues that share a cluster (job ids start at 1 in each)."""
    return f"wb-{queue_id}-{int(job_id)}-a{int(attempt)}"


class AlreadySubmitted(ClusterError):
    """The cluster already has a job with this submission id (the attempt was submitted)."""

    kind = "already_submitted"


class Unreachable(ClusterError):
    """The head did not answer (down, restarting, a network problem, a timeout)."""


class _NotFound(ClusterError):
    kind = "not_found"


class RayClient:
    """The few Jobs REST calls the workbench makes, with the cluster's token."""

    def __init__(self, cluster: Cluster, token: str | None, timeout_s: float = HTTP_TIMEOUT_S):
        self.cluster = cluster
        self.token = token
        self.timeout_s = timeout_s

    def call(self, method: str, path: str, body: dict | None = None,
             timeout_s: float | None = None):
        """The reply's JSON (or text, where it is not JSON); ClusterError with a clear message
        when the head cannot be reached, refuses the token, or answers an error."""
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.cluster.url + path, data=data, method=method,
                                         headers=headers)
        name, url = self.cluster.name, self.cluster.url
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as reply:
                text = reply.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            text = e.read().decode("utf-8", "replace")
            if e.code in (401, 403):
                raise ClusterError(
                    f"Cluster {name!r} ({url}) refused the request: its token is missing or "
                    f"wrong ({e.code}: {text.strip()[:200]}).",
                    "Set the token the head was started with (RAY_AUTH_TOKEN): `workbench "
                    f"cluster add {name} {url} --token-stdin`, or Settings > Clusters.") from e
            if e.code == 404:
                raise _NotFound(f"Cluster {name!r}: {path} not found ({text.strip()[:200]}).")
            if "try again later" in text or e.code == 503:  # a head still starting
                raise Unreachable(f"Cluster {name!r} ({url}) is not ready: "
                                  f"{_last_line(text)}", "Try again in a moment.") from e
            if "already exists" in text:
                raise AlreadySubmitted(f"Cluster {name!r} already has this job "
                                       f"({text.strip().splitlines()[-1][:200]}).") from e
            raise ClusterError(f"Cluster {name!r} ({url}) answered {e.code} to {method} "
                               f"{path}: {_last_line(text)}",
                               "See the Ray dashboard's logs on the head node.") from e
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise Unreachable(f"Cluster {name!r} cannot be reached at {url} ({reason}).",
                               "Check the URL (the Ray dashboard, port 8265 by default), that "
                               "the head runs, and that this machine may reach it.") from e
        try:
            return json.loads(text)
        except ValueError:
            return text


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no reply)"


def cluster_resources(client: RayClient) -> dict[str, float]:
    """The cluster's total resources ({"CPU": 2.0, "GPU": 0.0, ...}) from /api/cluster_status
    (empty while the head has not reported them yet)."""
    reply = client.call("GET", "/api/cluster_status")
    status = (reply.get("data") or {}).get("clusterStatus") or {} if isinstance(reply, dict) \
        else {}
    usage = (status.get("loadMetricsReport") or {}).get("usage") or {}
    return {key: float(pair[1]) for key, pair in usage.items()
            if isinstance(pair, list) and len(pair) == 2}


def check_cluster(cluster: Cluster, token: str | None) -> str:
    """What the cluster is, in a line ("Ray 2.60.0, 2 CPUs, 0 GPUs"); a ClusterError saying
    why not: unreachable, token missing or wrong, not a Ray dashboard."""
    client = RayClient(cluster, token)
    try:
        version = client.call("GET", "/api/version")
    except _NotFound as e:
        raise ClusterError(f"{cluster.url} is not a Ray dashboard (no /api/version).",
                           "Give the Ray dashboard's address, e.g. http://head-node:8265.") from e
    if not isinstance(version, dict) or "ray_version" not in version:
        raise ClusterError(f"{cluster.url} is not a Ray dashboard (its /api/version says "
                           f"{str(version)[:100]!r}).",
                           "Give the Ray dashboard's address, e.g. http://head-node:8265.")
    resources = cluster_resources(client)
    if not resources:  # the head reports them a few seconds after it starts
        return f"Ray {version['ray_version']} (its CPUs and GPUs are not reported yet)"
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    return f"Ray {version['ray_version']}, {cpus:g} CPUs, {gpus:g} GPUs"


# A job's output that says its Python cannot run the workbench: a module missing (Python's own
# "No module named app", or the workbench's MissingModuleError), the interpreter not found.
_ENVIRONMENT_PROBLEM = re.compile(r"No module named '?[\w.]+'?|^.*: (?:command )?not found$",
                                  re.MULTILINE)


def environment_problem(output: str) -> str | None:
    """The line of a job's `output` that says its Python cannot run the workbench, or None.
    Running such a job again cannot help."""
    found = _ENVIRONMENT_PROBLEM.findall(output)
    return found[-1].strip()[:300] if found else None


def environment_error(cluster: Cluster, problem: str) -> ClusterError:
    return ClusterError(
        f"Cluster {cluster.name!r} cannot run the workbench with its Python "
        f"({cluster.python}): {problem}",
        "Install the workbench (the version of this machine) with its dependencies into that "
        f"Python on the cluster's nodes, or name the Python that has it: `workbench cluster add "
        f"{cluster.name} {cluster.url} --python PATH` (Settings > Clusters).")


# The job of `probe_cluster`, run by the cluster's Python: imports what `queue run-remote`
# imports, then, for each cluster prefix of the path map, reads the file this machine wrote
# there and writes a reply beside it. Its one line of JSON starts with PROBE_MARK.
PROBE_MARK = "WORKBENCH_PROBE "
_PROBE_SCRIPT = """
import json, sys
out, files = {"python": sys.executable}, {}
try:
    import app, app.cli.main, app.engine.runs.remote, app.engine.runs.kinds
    out["version"] = app.__version__
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
token = sys.argv[1]
for prefix in sys.argv[2:]:
    name = prefix.rstrip("/") + "/.workbench-probe-" + token
    try:
        with open(name) as f:
            seen = f.read()
        with open(name + ".reply", "w") as f:
            f.write(seen + " read")
        files[prefix] = "ok" if seen == token else "it holds something else"
    except OSError as e:
        files[prefix] = str(e)
out["files"] = files
print(%r + json.dumps(out), flush=True)
""" % PROBE_MARK


def probe_cluster(cluster: Cluster, token: str | None, *,
                  timeout_s: float = PROBE_TIMEOUT_S, poll_s: float = 0.5) -> str:
    """Run a small job on the cluster (no CPU asked, so a busy cluster runs it too) that imports
    the workbench with the cluster's Python, says its version, and, for each pair of the path
    map, reads a file this machine wrote under the local prefix through the cluster's prefix
    and writes one back. A line saying what it found ("workbench 0.1.0 (as here) at
    /opt/wb/bin/python; path map: /home/me/runs=/mnt/runs written and read both ways"), or a
    ClusterError saying what is wrong: a Python without the workbench (and what it lacks),
    another version of it, a folder of the path map the cluster does not see as this machine's.
    """
    from app import __version__

    client = RayClient(cluster, token)
    mark = secrets.token_hex(8)
    pairs = cluster.path_map.pairs
    written = []
    try:
        for local, _ in pairs:
            path = os.path.join(local, f".workbench-probe-{mark}")
            try:
                with open(path, "x") as f:
                    f.write(mark)
            except OSError as e:
                raise ClusterError(f"Cannot write a test file in {local} (the path map's folder "
                                   f"on this machine): {e.strerror or e}.",
                                   "Map a folder of this machine that exists and that you may "
                                   "write to (Settings > Clusters).") from e
            written.append(path)
        output = _run_probe(client, mark, [remote for _, remote in pairs], timeout_s, poll_s)
        found = _probe_result(cluster, output)
        replies = {}
        for path, (local, remote) in zip(written, pairs):
            try:
                with open(path + ".reply") as f:
                    replies[f"{local}={remote}"] = f.read() == mark + " read"
            except OSError:
                replies[f"{local}={remote}"] = False
    finally:
        for path in written:
            for name in (path, path + ".reply"):
                with suppress(OSError):
                    os.remove(name)
    if found.get("error"):
        raise environment_error(cluster, found["error"])
    if found.get("version") != __version__:
        raise ClusterError(
            f"Cluster {cluster.name!r} runs workbench {found.get('version')} "
            f"({found.get('python')}); this machine runs {__version__}.",
            "Install the same version on both: the run folder is their contract.")
    for local, remote in pairs:
        status = (found.get("files") or {}).get(remote, "the test job did not look")
        if status != "ok" or not replies.get(f"{local}={remote}"):
            why = status if status != "ok" else "its reply did not arrive here"
            raise ClusterError(
                f"Cluster {cluster.name!r} does not see {local} of this machine as {remote}: "
                f"{why}.", "Fix the path map (LOCAL=CLUSTER) in Settings > Clusters, or mount "
                           "the shared storage on the nodes.")
    where = (f"; path map {cluster.path_map} written and read both ways" if pairs else
             "; no path map" + (" (a head on this machine sees its paths)" if cluster.is_loopback
                                else ": runs cannot be sent"))
    return f"workbench {__version__} (as here) at {found.get('python')}{where}"


def cluster_test(cluster: Cluster, token: str | None) -> Iterator[tuple[str, str]]:
    """What `workbench cluster test` and Settings' "Test connection" say, one answer at a time:
    ("Connected", `check_cluster`'s line: reachable, its Ray version, CPUs and GPUs), then
    ("Runs a job", `probe_cluster`'s line: a job there imports this workbench, the path map
    written and read both ways). A ClusterError from either ends it. Each answer may take
    seconds (the job up to PROBE_TIMEOUT_S): the window asks for the next one off its thread."""
    yield "Connected", check_cluster(cluster, token)
    yield "Runs a job", probe_cluster(cluster, token)


def _run_probe(client: RayClient, mark: str, prefixes: list[str], timeout_s: float,
               poll_s: float) -> str:
    """Submit the probe job, wait for its end (stopped after `timeout_s`), return its output."""
    command = " ".join(shlex.quote(a) for a in (client.cluster.python, "-c", _PROBE_SCRIPT,
                                                mark, *prefixes))
    job = f"wb-probe-{mark}"
    client.call("POST", "/api/jobs/", {"entrypoint": command, "submission_id": job,
                                       "metadata": {"workbench_probe": "1"}},
                timeout_s=SUBMIT_TIMEOUT_S)
    deadline = time.monotonic() + timeout_s
    while True:
        status = client.call("GET", f"/api/jobs/{job}")
        state = status.get("status") if isinstance(status, dict) else None
        if state in ("SUCCEEDED", "FAILED", "STOPPED"):
            break
        if time.monotonic() > deadline:
            with suppress(ClusterError):
                client.call("POST", f"/api/jobs/{job}/stop")
            raise ClusterError(f"Cluster {client.cluster.name!r} did not run the test job "
                               f"within {timeout_s:g} s (it is {state}).",
                               "See the Ray dashboard (Jobs) for why it waits.")
        time.sleep(poll_s)
    logs = client.call("GET", f"/api/jobs/{job}/logs")
    return logs.get("logs", "") if isinstance(logs, dict) else str(logs)


def _probe_result(cluster: Cluster, output: str) -> dict:
    """The probe's JSON line in its `output`; a ClusterError when it has none."""
    for line in reversed(output.splitlines()):
        if line.startswith(PROBE_MARK):
            try:
                return json.loads(line[len(PROBE_MARK):])
            except ValueError:
                break
    problem = environment_problem(output)
    if problem:
        raise environment_error(cluster, problem)
    raise ClusterError(f"Cluster {cluster.name!r}: the test job ended without its answer; its "
                       f"output ends: {_last_line(output)}",
                       "See the job in the Ray dashboard (Jobs).")


class RayExecutor:
    """Runs attempts of jobs on `cluster` (see the module's docstring)."""

    def __init__(self, cluster: Cluster, token: str | None, *, queue_id: str,
                 stop_grace_s: float = DEFAULT_STOP_GRACE_S):
        self.cluster = cluster
        self.queue_id = queue_id  # the queue whose jobs this submits (see `submission_id`)
        self.name = cluster.name
        self.client = RayClient(cluster, token)
        self.stop_grace_s = stop_grace_s

    def check(self) -> str:
        return check_cluster(self.cluster, self.client.token)

    def resources(self) -> dict[str, float]:
        return cluster_resources(self.client)

    def entrypoint(self, run_dir) -> str:
        where = self.cluster.cluster_path(run_dir)
        command = f"{shlex.quote(self.cluster.python)} -m app queue run-remote {shlex.quote(where)}"
        if self.cluster.path_map.pairs:  # the config's files (model, data) are mapped too
            command += f" --path-map {shlex.quote(str(self.cluster.path_map))}"
        return command

    def submit(self, job, run_dir) -> dict:
        """Start attempt `job.attempt` of `job`; AlreadySubmitted if the cluster has it."""
        handle = self.handle_for(job.id, job.attempt)
        self.client.call("POST", "/api/jobs/", {
            "entrypoint": self.entrypoint(run_dir),
            "submission_id": handle["submission_id"],
            "entrypoint_num_cpus": self.cluster.num_cpus,
            "entrypoint_num_gpus": self.cluster.num_gpus,
            # Ray reads it as an integer number of seconds
            "runtime_env": {"env_vars": {
                "RAY_JOB_STOP_WAIT_TIME_S": str(math.ceil(self.stop_grace_s)),
                SUBMISSION_ENV: handle["submission_id"]}},
            "metadata": {"workbench_job": str(job.id), "attempt": str(job.attempt)},
        })  # HTTP_TIMEOUT_S: see there
        return handle

    def handle_for(self, job_id: int, attempt: int) -> dict:
        """The handle attempt `attempt` of job `job_id` has (or will have) on the cluster."""
        return {"submission_id": submission_id(self.queue_id, job_id, attempt),
                "cluster": self.cluster.name}

    def poll(self, handle: dict) -> Poll:
        try:
            reply = self.client.call("GET", f"/api/jobs/{quote(handle['submission_id'])}")
        except _NotFound:
            return Poll("lost", f"cluster {self.name!r} has no job "
                                f"{handle['submission_id']} (lost, or the head restarted)")
        if not isinstance(reply, dict) or reply.get("status") not in _STATES:
            raise ClusterError(f"Cluster {self.name!r} answered an unexpected job status: "
                               f"{str(reply)[:200]}")
        return Poll(_STATES[reply["status"]], reply.get("message") or "")

    def cancel(self, handle: dict) -> None:
        try:
            self.client.call("POST", f"/api/jobs/{quote(handle['submission_id'])}/stop")
        except _NotFound:
            pass  # nothing left to stop

    def logs(self, handle: dict) -> str:
        try:
            reply = self.client.call("GET", f"/api/jobs/{quote(handle['submission_id'])}/logs")
        except _NotFound:
            return ""
        return reply.get("logs", "") if isinstance(reply, dict) else str(reply)
