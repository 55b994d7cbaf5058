"""A run's LoRA targets are decided before the run exists: targets llama.cpp cannot load, or
that match nothing on the model, stop `workbench train` / `grpo` with exit 2 and no run folder."""

from __future__ import annotations

import json

import pytest

from app.cli.main import run_cli
from app.engine.errors import ConfigError
from app.engine.model.lora import check_model_targets
from tests.conftest import GOLDEN

GEMMA = GOLDEN / "gemma3-q8_0.gguf"          # ties its output head to the embedding


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"Row {i}."}) for i in range(4)) + "\n")
    return path


@pytest.mark.parametrize("command", ["train", "grpo"])
def test_embeddings_target_on_a_tied_model_is_refused_before_the_run(tmp_path, data, capsys,
                                                                     command):
    out = tmp_path / "run"
    data = ["--data", str(data)] if command == "train" else ["--prompts", str(data), "-r", "exact"]
    assert run_cli([command, "-m", str(GEMMA), *data, "--targets", "attn,embeddings",
                    "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "ties its output head" in err and "GGML_ASSERT(ggml_can_mul_mat)" in err
    assert "hint: Train without the embeddings target" in err
    assert not out.exists()


def test_a_target_that_matches_nothing_names_the_available_ones(tmp_path, data, capsys):
    out = tmp_path / "run"
    assert run_cli(["train", "-m", str(GEMMA), "--data", str(data), "--targets", "attn,output",
                    "--out", str(out), "--queue"]) == 2
    err = capsys.readouterr().err
    assert "output" in err and "tied to the embedding" in err
    assert "This model's targets: attention, ffn, embeddings." in err
    assert not out.exists()


def test_the_rule_the_window_calls():
    assert check_model_targets(GOLDEN / "llama-f32.gguf", ("attention", "embeddings")) == []
    # the FFN layout of the other kind: fine when the model's own FFN is targeted too
    assert check_model_targets(GOLDEN / "mixtral-f32.gguf", ("attention", "ffn", "experts")) == []
    warned = check_model_targets(GOLDEN / "llama-f32.gguf", ("attention", "experts"))
    assert warned and "experts" in warned[0]
    with pytest.raises(ConfigError, match="ffn_up_exps"):
        check_model_targets(GOLDEN / "llama-f32.gguf", ("ffn_up_exps",))
