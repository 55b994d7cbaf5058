"""`new-model` and `logits` write only where the user says, under the rule of every writer
(app.engine.runs.destinations): never over their input, an existing file only with
--overwrite; `new-model` refuses a shape that cannot fit in memory before allocating it;
`logits` makes its folder, and a read-only one is said. (issue 28, points 3, 5 and 8)"""

from __future__ import annotations

import errno
import hashlib
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app.cli.main import run_cli
from app.engine.runtime import files
from tests.conftest import GOLDEN

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--layers", "1", "--width", "16", "--heads", "2", "--ffn", "16"]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def tokenizer(tmp_path) -> Path:
    path = tmp_path / "m.gguf"
    shutil.copy(GOLDEN / "llama-f32.gguf", path)
    return path


def test_new_model_never_replaces_its_tokenizers_model(tokenizer, tmp_path, capsys):
    before = digest(tokenizer)
    link = tmp_path / "link.gguf"
    os.link(tokenizer, link)
    for out in (tokenizer, link):
        for extra in ([], ["--overwrite"]):
            assert run_cli(["new-model", "--tokenizer", str(tokenizer), "-o", str(out), *SMALL,
                            *extra]) == 2
            assert ("would write over the model whose tokenizer it copies"
                    in capsys.readouterr().err)
    assert digest(tokenizer) == before


def test_new_model_replaces_a_file_only_with_overwrite(tokenizer, tmp_path, capsys):
    out = tmp_path / "precious.txt"
    out.write_text("mine")
    assert run_cli(["new-model", "--tokenizer", str(tokenizer), "-o", str(out), *SMALL]) == 2
    assert f"error: {out} exists already." in capsys.readouterr().err
    assert out.read_text() == "mine"
    assert run_cli(["new-model", "--tokenizer", str(tokenizer), "-o", str(out), *SMALL,
                    "--overwrite"]) == 0
    assert out.read_bytes()[:4] == b"GGUF"


def test_new_model_refuses_a_shape_larger_than_memory_before_allocating(tokenizer, tmp_path):
    """4 layers of width and FFN 40,000: 179 GB of float32 tensors. Refused at once, in a
    process of its own whose address space is capped at 16 GB: without the check it would
    fail allocating (a traceback) rather than bring the OOM killer onto the test run."""
    out = tmp_path / "huge.gguf"
    cap = lambda: resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))  # noqa: E731
    proc = subprocess.run([sys.executable, "-m", "app", "new-model", "--tokenizer",
                           str(tokenizer), "-o", str(out), "--layers", "4", "--width", "40000",
                           "--ffn", "40000"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, preexec_fn=cap)
    assert proc.returncode == 2, proc.stderr
    assert "error: A model of this shape has 44.82B parameters: making it needs about 178.9 GB" \
           in proc.stderr
    assert "and this machine has" in proc.stderr and "hint: Choose fewer layers" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def logits_cli(out, *extra) -> int:
    return run_cli(["logits", "-m", str(GOLDEN / "llama-f32.gguf"), "--tokens", "1,2,3",
                    "-o", str(out), *extra])


def test_logits_into_a_missing_folder_at_the_exact_path(tmp_path, capsys):
    out = tmp_path / "new" / "folder" / "logits"              # no .npy added
    assert logits_cli(out) == 0
    assert np.load(out).shape[0] == 3
    assert sorted(p.name for p in out.parent.iterdir()) == ["logits"]
    assert logits_cli(out) == 2
    assert f"error: {out} exists already." in capsys.readouterr().err
    assert logits_cli(out, "--overwrite") == 0
    assert logits_cli(GOLDEN / "llama-f32.gguf", "--overwrite") == 2
    assert "would write over the model" in capsys.readouterr().err


def test_logits_into_a_read_only_folder(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    real_open = os.open

    def read_only(path, flags, *args):   # as on a read-only mount (root ignores chmod 0555)
        if os.path.dirname(path) == str(folder) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args)
    monkeypatch.setattr(files.os, "open", read_only)
    assert logits_cli(folder / "x.npy") == 2
    err = capsys.readouterr().err
    assert f"error: {folder} is read-only: could not write x.npy." in err
    assert "Traceback" not in err and list(folder.iterdir()) == []
