"""Without Ray installed (issue 23): the app, a queued local run and its worker work; a
cluster is reached over HTTP (the Jobs API needs no Ray here); only a data-parallel run says
that it needs Ray, and how to install it. Run in a child process whose imports of `ray` fail,
as on a machine without it (the test extra installs Ray here)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.conftest import REPO
from tests.engine.runs.cluster_runs import train_args

CHILD = textwrap.dedent("""
    import importlib.abc, json, sys

    class NoRay(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "ray" or name.startswith("ray."):
                raise ImportError(f"No module named {name!r}")

    sys.meta_path.insert(0, NoRay())
    import app.engine.api as api                     # everything the window imports
    from app.cli.main import run_cli
    from app.engine.errors import ConfigError
    from app.engine.runs.data_parallel import run_data_parallel
    from app.engine.runs.queue import JobQueue
    from app.engine.runs.rundir import RunDir
    from app.engine.runs.worker import run_worker

    args, queue_path, out = json.loads(sys.argv[1])
    assert run_cli(args + ["--queue", queue_path]) == 0
    queue = JobQueue(queue_path)
    run_worker(queue, once=True, exclusive=False)
    result = {"state": queue.find(out)[0].state, "adapter": (RunDir(out).path / "adapter.gguf").exists()}
    try:
        api.check_cluster(api.Cluster("lab", "http://127.0.0.1:9"), None)
    except api.ClusterError as e:
        result["cluster"] = e.message
    run = RunDir(out)
    run.write_config({**run.config(), "workers": 2})
    try:
        run_data_parallel(run, None)
    except ConfigError as e:
        result["data_parallel"] = [e.message, e.hint]
    result["ray_loaded"] = any(m == "ray" or m.startswith("ray.") for m in sys.modules)
    print(json.dumps(result))
""")


def test_the_app_and_a_local_run_work_without_ray(tmp_path):
    out = tmp_path / "run"
    payload = json.dumps([train_args(out, 2), str(tmp_path / "q.sqlite3"), str(out)])
    done = subprocess.run([sys.executable, "-c", CHILD, payload], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["state"] == "done" and result["adapter"]
    assert "cannot be reached" in result["cluster"]
    message, hint = result["data_parallel"]
    assert "needs Ray" in message and 'pip install "ray[default,train]' in hint
    assert not result["ray_loaded"]
