"""A loopback Ray head for the cluster tests: token authentication on, a small object store,
free ports, its own temp folder, stopped (its whole process group) when the session ends.

Use the `ray_head` fixture (registered in tests/conftest.py); it skips where Ray is not
installed (`pip install -e ".[test]"` installs it). One head serves the whole session: it
takes ~5 s to start. Never `ray stop` here: that stops every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class RayHead:
    dashboard_url: str      # the Jobs REST API: {dashboard_url}/api/jobs/
    gcs_address: str        # ray.init(address=...) from a driver on this machine
    token: str
    temp_dir: Path

    def env(self) -> dict:
        """The environment a driver (ray.init) on this machine needs to join the head."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
                "RAY_ADDRESS": self.gcs_address}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_executable() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else (shutil.which("ray") or "ray")


def _wait_ready(url: str, token: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    request = urllib.request.Request(f"{url}/api/jobs/",
                                     headers={"Authorization": f"Bearer {token}"})
    last = None
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(request, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError as e:
            last = e
        time.sleep(0.5)
    raise RuntimeError(f"the loopback Ray head did not answer at {url} within {deadline_s} s: {last}")


def start_head(num_cpus: int = 4, deadline_s: float = 90.0):
    """Start a head; returns (RayHead, the `ray start --block` process)."""
    token = secrets.token_hex(16)
    # Ray's socket paths must stay short (AF_UNIX: 107 bytes): a short folder under /tmp.
    temp_dir = Path(tempfile.mkdtemp(prefix="wbray-", dir="/tmp"))
    gcs_port, dashboard_port = _free_port(), _free_port()
    # Every port a head listens on is a free one: with Ray's fixed defaults, a second head on
    # the machine (another test session) starts, but its dashboard agent cannot bind 52365 and
    # its Jobs API answers "No available agent to submit job" forever.
    agent_ports = {option: _free_port() for option in (
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
        "runtime-env-agent-port", "ray-client-server-port")}
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token,
               RAY_USAGE_STATS_ENABLED="0", AUTOSCALER_METRIC_PORT=str(_free_port()),
               DASHBOARD_METRIC_PORT=str(_free_port()))
    command = [_ray_executable(), "start", "--head", "--block",
               "--node-ip-address=127.0.0.1", f"--port={gcs_port}",
               *(f"--{option}={port}" for option, port in agent_ports.items()),
               f"--dashboard-port={dashboard_port}", "--dashboard-host=127.0.0.1",
               "--include-dashboard=true", f"--num-cpus={num_cpus}", "--num-gpus=0",
               "--object-store-memory=100000000", f"--temp-dir={temp_dir}",
               "--disable-usage-stats"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                               stderr=open(temp_dir / "head.log", "wb"), start_new_session=True)
    head = RayHead(f"http://127.0.0.1:{dashboard_port}", f"127.0.0.1:{gcs_port}", token, temp_dir)
    try:
        _wait_ready(head.dashboard_url, token, deadline_s)
    except BaseException:
        stop_head(process, temp_dir)
        raise
    return head, process


def _descendants(root: int) -> list[int]:
    """Every process below `root` now (from /proc): Ray starts job drivers in sessions of their
    own, so the head's process group alone misses them."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop_head(process: subprocess.Popen, temp_dir: Path, grace_s: float = 5.0) -> None:
    """SIGTERM the head and every process below it (job drivers included), SIGKILL whatever is
    left after `grace_s`, and remove its temp folder."""
    pids = [process.pid] + _descendants(process.pid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while time.monotonic() < end and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_head():
    pytest.importorskip("ray", reason="Ray is not installed (the test extra installs it)")
    head, process = start_head()
    try:
        yield head
    finally:
        stop_head(process, head.temp_dir)
