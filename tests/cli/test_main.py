"""The `workbench` command line on the golden models: info, logits, generate, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from app.cli.main import run_cli
from tests.conftest import GOLDEN


def test_info_prints_the_card(capsys):
    assert run_cli(["info", str(GOLDEN / "qwen2moe-q4_0.gguf")]) == 0
    out = capsys.readouterr().out
    assert "qwen2moe" in out and "4 (2 used per token), shared expert (sigmoid-gated)" in out
    assert "Q4_0 x22" in out and "LoRA run estimate" in out


def test_info_json(capsys):
    assert run_cli(["info", str(GOLDEN / "deepseek-f32.gguf"), "--json"]) == 0
    card = json.loads(capsys.readouterr().out)
    assert card["config"]["arch"] == "deepseek"
    assert card["config"]["leading_dense_blocks"] == 1
    assert card["config"]["expert_weights_scale"] == pytest.approx(1.5)
    assert card["n_params"] == 50656  # golden.json
    assert card["memory"]["total"] > card["memory"]["weights"] > 0


def test_logits_writes_the_reference_logits(tmp_path, capsys):
    ref = np.load(GOLDEN / "mixtral.npz")
    out = tmp_path / "x.npy"
    tokens = ",".join(map(str, ref["tokens"]))
    assert run_cli(["logits", "-m", str(GOLDEN / "mixtral-f32.gguf"), "-a",
                    str(GOLDEN / "mixtral-lora.gguf"), "-s", "0.5", "--tokens", tokens,
                    "-o", str(out)]) == 0
    np.testing.assert_allclose(np.load(out), ref["logits_f32_lora_half"], atol=1e-4)


def test_generate_streams_greedy_tokens(capsys):
    # Golden vocab: token id == byte value for 0..255, so the output text is the greedy bytes.
    assert run_cli(["generate", "-m", str(GOLDEN / "llama-f32.gguf"), "-p", "hello",
                    "-n", "5"]) == 0
    assert len(capsys.readouterr().out) > 0


def test_bad_input_gives_message_hint_and_status_2(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 16)
    assert run_cli(["info", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "hint: " in err
    assert run_cli(["logits", "-m", str(GOLDEN / "llama-f32.gguf"), "--tokens", "1,x",
                    "-o", str(tmp_path / "y.npy")]) == 2
    assert run_cli(["logits", "-m", str(GOLDEN / "llama-f32.gguf"), "--tokens", "1,99999",
                    "-o", str(tmp_path / "y.npy")]) == 2


def test_console_entry_point_runs_as_module():
    proc = subprocess.run([sys.executable, "-m", "app", "info", str(GOLDEN / "gemma3-q8_0.gguf")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "gemma3" in proc.stdout


def test_engine_imports_no_qt():
    """The engine is headless: importing it (and the CLI) must not load Qt or pyqtgraph."""
    code = ("import sys, app.engine, app.engine.model.card, app.cli.main; "
            "bad = [m for m in sys.modules if m.startswith(('PySide6', 'pyqtgraph', 'app.views'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
