"""A run folder's own files and the user's state files read by the workbench (config.json,
status.json, metrics.jsonl, the registry runs.jsonl, clusters.json) are read only when they are
regular files of a sane size: a FIFO, a link to /dev/zero or a 20 GB sparse file in one run
makes that run "unreadable: ..." (its config an error naming the file), never a hang or runaway
memory (a huge metrics.jsonl is read from its last 64 MB: rundir.METRICS_READ_MAX). Each case runs in a subprocess with a timeout and a 3 GB address-space limit: without
the checks, a FIFO blocks open() forever and /dev/zero or the sparse file fills memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from app.engine.runs.rundir import RunDir

SPARSE_BYTES = 20 << 30
KINDS = ("fifo", "dev-zero link", "20 GB sparse file")


def _plant(path, kind: str) -> None:
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero link":
        path.symlink_to("/dev/zero")
    else:
        with open(path, "wb"):
            pass
        os.truncate(path, SPARSE_BYTES)


def _run(code: str, state, timeout: float = 60) -> dict:
    """`code` (it prints one JSON line) in a fresh Python, within `timeout` seconds and 3 GB."""
    prelude = ("import json, resource\n"
               "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n")
    env = dict(os.environ, WORKBENCH_QUEUE=str(state / "queue.sqlite3"))
    proc = subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def run(tmp_path):
    run = RunDir.create(tmp_path / "runs" / "a", {"model": "/m.gguf", "data": "/d.jsonl"})
    run.write_status(state="done", step=2, total_steps=2)
    run.append_metrics({"type": "eval", "step": 2, "loss": 1.5})
    yield run
    for name in ("config.json", "status.json", "metrics.jsonl"):   # no 20 GB file left behind
        (run.path / name).unlink(missing_ok=True)


@pytest.mark.parametrize("name", ["config.json", "status.json", "metrics.jsonl"])
@pytest.mark.parametrize("kind", KINDS)
def test_one_odd_file_makes_its_run_unreadable_and_never_hangs(run, tmp_path, name, kind):
    good = RunDir.create(tmp_path / "runs" / "b", {"model": "/m.gguf", "data": "/d.jsonl"})
    _plant(run.path / name, kind)
    found = _run(f"""
        from app.engine.errors import EngineError
        from app.engine.runs.rundir import RunDir, list_runs, run_entry
        rows = {{str(r.path): r.state for r in map(run_entry, [r.path for r in list_runs(
            {str(run.path.parent)!r})] + [{str(run.path)!r}])}}
        run = RunDir({str(run.path)!r})
        try:
            run.config()
            config = None
        except EngineError as e:
            config = [type(e).__name__, e.message, e.hint]
        print(json.dumps({{"rows": rows, "config": config,
                          "problems": run.summary()["problems"]}}))
        """, tmp_path)
    assert found["rows"][str(good.path)] == "new"        # the other run is listed as it is
    state = found["rows"][str(run.path)]
    if name == "metrics.jsonl" and kind == "20 GB sparse file":
        assert state == "done"                               # its last 64 MB: no events
        assert found["problems"] == ["Only the last 64.0 MB of metrics.jsonl (20.0 GB) were read."]
        return
    what = {"fifo": "named pipe", "dev-zero link": "character device",
            "20 GB sparse file": "20.0 GB"}[kind]
    assert state.startswith("unreadable: ") and name in state and what in state, state
    if name == "config.json":
        assert found["config"][0] == "ConfigError" and what in found["config"][1]
    else:
        assert found["config"] is None
        assert any(what in p and name in p for p in found["problems"]), found["problems"]


@pytest.mark.parametrize("kind", KINDS)
def test_an_odd_registry_or_cluster_list_is_an_error_naming_it(tmp_path, kind):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    try:
        for name in ("runs.jsonl", "clusters.json"):
            _plant(state / name, kind)
        found = _run("""
            from app.engine.errors import EngineError
            from app.engine.runs.clusters import ClusterStore
            from app.engine.runs.rundir import registered_runs
            out = []
            for read in (registered_runs, lambda: ClusterStore().list()):
                try:
                    read()
                    out.append(None)
                except EngineError as e:
                    out.append(e.message)
            print(json.dumps(out))
            """, state)
    finally:
        for name in ("runs.jsonl", "clusters.json"):
            (state / name).unlink(missing_ok=True)
    what = {"fifo": "named pipe", "dev-zero link": "character device",
            "20 GB sparse file": "20.0 GB"}[kind]
    assert [what in m and name in m for m, name in
            zip(found, ("runs.jsonl", "clusters.json"))] == [True, True], found


def test_a_long_runs_metrics_are_read_from_their_last_bytes(run, monkeypatch):
    """A metrics.jsonl longer than METRICS_READ_MAX: the last events are read, from the first
    whole line in the window, and a tail reader goes on from the offset returned."""
    from app.engine.runs import rundir

    for step in range(3, 200):
        run.append_metrics({"type": "step", "step": step, "loss": 1.0})
    monkeypatch.setattr(rundir, "METRICS_READ_MAX", 1000)
    events, offset = run.read_metrics(0)
    steps = [e["step"] for e in events]
    assert steps == list(range(steps[0], 200)) and 180 < steps[0] < 199
    assert offset == run.metrics_path.stat().st_size
    run.append_metrics({"type": "step", "step": 200, "loss": 1.0})
    assert [e["step"] for e in run.read_metrics(offset)[0]] == [200]


@pytest.mark.parametrize("name, kind", [(name, kind) for name in ("meta.json", "manifest.json")
                                         for kind in KINDS]
                         + [("arrays.npz", kind) for kind in KINDS[:2]])
def test_an_odd_checkpoint_file_is_a_damaged_checkpoint_never_a_hang(tmp_path, name, kind):
    """(arrays.npz has no cap: a model's optimizer state may be many GB; a huge one costs a
    checksum's read, bounded by its size.)"""
    import numpy as np

    from app.engine.training.checkpoints import save_checkpoint

    step = save_checkpoint(tmp_path / "checkpoints", 2, {"w": np.ones(3, np.float32)},
                           {"run": {"best_step": 2, "best_loss": 1.0}})
    _plant(step / name, kind)
    try:
        found = _run(f"""
            from app.engine.training.checkpoints import (DamagedCheckpoint, best_checkpoint,
                                                         load_checkpoint)
            try:
                load_checkpoint({str(step)!r})
                damage = None
            except DamagedCheckpoint as e:
                damage = e.message
            print(json.dumps([damage, best_checkpoint({str(step.parent)!r})], default=str))
            """, tmp_path)
    finally:
        (step / name).unlink(missing_ok=True)
    what = {"fifo": "named pipe", "dev-zero link": "character device",
            "20 GB sparse file": "20.0 GB"}[kind]
    assert what in found[0] and name in found[0], found
    assert (found[1] is None) == (name == "meta.json")   # best_checkpoint reads meta.json


@pytest.mark.parametrize("kind", KINDS)
def test_an_odd_trust_list_trusts_nothing_and_is_replaced_when_trusting(tmp_path, kind):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    reward = tmp_path / "rew.py"
    reward.write_text("def reward(prompt, completion, **row):\n    return 1\n")
    _plant(state / "trusted-rewards.json", kind)
    try:
        found = _run(f"""
            from app.engine.training.reward_functions import (RewardSpec, trust_reward_files,
                                                              untrusted_reward_files)
            specs = [RewardSpec("file", arg={str(reward)!r})]
            before = untrusted_reward_files(specs)
            trust_reward_files(specs)
            print(json.dumps([before, untrusted_reward_files(specs)]))
            """, state)
    finally:
        (state / "trusted-rewards.json").unlink(missing_ok=True)
    assert found == [[str(reward)], []]
