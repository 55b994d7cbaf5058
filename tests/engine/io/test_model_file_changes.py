"""A model file that changes while it is memory-mapped (issue 28, point 7): every tensor read
checks the file first (ModelFileChanged), and a SIGBUS that still happens (the file truncated
between the check and the read) fails the run with a message instead of killing it silently."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from app.engine.io.gguf import GGUFFile, ModelFileChanged
from tests.conftest import REPO, SAMPLE_DATA

MODEL = SAMPLE_DATA / "tiny-moe.gguf"


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copy(MODEL, path)
    return path


def test_a_truncated_rewritten_or_replaced_file_is_refused_before_a_read(model, tmp_path):
    name = "token_embd.weight"
    f = GGUFFile(model)
    assert f.change() is None and f.raw(name).size
    size = model.stat().st_size
    os.truncate(model, size // 2)
    assert f.change() == f"it was truncated from {size:,} to {size // 2:,} bytes"
    with pytest.raises(ModelFileChanged, match=f"The model file changed while in use: {model}"):
        f.raw(name)

    shutil.copy(MODEL, model)            # the same bytes again: rewritten, another mtime
    g = GGUFFile(model)
    os.utime(model, ns=(1, 1))
    assert g.change() == "it was rewritten"
    h = GGUFFile(model)
    shutil.copy(MODEL, tmp_path / "other.gguf")
    os.replace(tmp_path / "other.gguf", model)
    assert h.change() == "another file was put in its place"
    with pytest.raises(ModelFileChanged):
        h.raw(name)


@pytest.mark.skipif(os.name != "posix", reason="SIGBUS")
def test_a_bus_error_on_the_mapping_fails_the_run_with_the_file_named(model, tmp_path):
    """The last resort: a read that bypasses the check faults; the run's reporter still
    records the failure and the process ends with exit status 2 and a message."""
    script = textwrap.dedent(f"""
        import os
        from app.engine.io.gguf import GGUFFile
        from app.engine.runs.reporter import RunReporter
        from app.engine.runs.rundir import RunDir
        run = RunDir.create({str(tmp_path / 'run')!r}, {{"model": "m", "data": "d"}})
        RunReporter(run).started()
        f = GGUFFile({str(model)!r})
        view = f._data                       # a view of the mapping, read without a check
        os.truncate({str(model)!r}, 4096)
        print(int(view[-1]))                 # SIGBUS
        """)
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2, r.stderr       # before: -7 (SIGBUS), no message
    assert f"error: The model file changed while in use: {model} (it was truncated" in r.stderr
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["state"] == "failed" and status["error"]["kind"] == "model_changed"
    assert str(model) in status["error"]["message"]
