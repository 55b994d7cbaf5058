"""A new user's first run from the command line (issue 21): the defaults come from the config
classes and `--help` prints them, the context follows the model's, the run is listed wherever
its folder is, and `workbench export` takes the best checkpoint."""

from __future__ import annotations

import shutil

import pytest

from app.cli.main import build_parser, run_cli
from app.cli.train import run_config_from_args
from app.engine.runs.rundir import registered_runs
from app.engine.training.config import FULL_LR, LORA_LR, LORA_LR_ALPHA, TrainConfig, default_lr
from app.engine.training.sft import RunConfig
from tests.conftest import SAMPLE_DATA

MODEL, DATA = str(SAMPLE_DATA / "tiny-moe.gguf"), str(SAMPLE_DATA / "chat.jsonl")


def _config(*extra):
    return run_config_from_args(build_parser().parse_args(["train", "-m", MODEL, "-d", DATA,
                                                           *extra]))


def test_help_prints_the_defaults_of_the_config_classes(capsys):
    with pytest.raises(SystemExit):
        run_cli(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    t = TrainConfig()
    for expected in (f"LoRA rank (default: {t.lora_rank})", f"(default: {t.schedule})",
                     f"global gradient-norm clip (0: off) (default: {t.max_grad_norm:g})",
                     f"(default: {t.warmup_fraction:g})", f"(default: {RunConfig.epochs})",
                     f"(default: {LORA_LR:g} x sqrt({LORA_LR_ALPHA:g} / alpha) for LoRA",
                     f"{FULL_LR:g} for full fine-tuning"):                # train.LR_HELP
        assert expected in text


def test_the_defaults_reach_the_run_with_the_models_context():
    config = _config()
    assert config.data_config.context == 256      # the sample model's context, not 512
    assert (config.train.lr, config.train.schedule, config.train.max_grad_norm) == (
        TrainConfig().lr, "cosine", 1.0)
    assert TrainConfig().lr == default_lr("lora", TrainConfig().lora_alpha) == 3.5e-3
    assert _config("--alpha", "16", "--rank", "64").train.lr == LORA_LR == 5e-3
    assert _config("--alpha", "128").train.lr == 1.8e-3
    assert _config("--mode", "full").train.lr == FULL_LR
    assert _config("--mode", "full", "--lr", "1e-3").train.lr == 1e-3


def test_a_context_longer_than_the_models_is_refused_before_a_folder_exists(tmp_path, capsys):
    assert run_cli(["train", "-m", MODEL, "-d", DATA, "--ctx", "512", "-o",
                    str(tmp_path / "run")]) == 2
    assert "longer than the model's (256 tokens)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_readme_run_is_listed_exported_at_its_best_and_missing_once_deleted(tmp_path,
                                                                                capsys):
    out = tmp_path / "some" / "other" / "folder"
    assert run_cli(["train", "-m", MODEL, "-d", DATA, "--rank", "8", "--alpha", "16",
                    "--targets", "attn,experts,router", "--max-steps", "12", "--epochs", "1",
                    "--val-split", "0.1", "--eval-every", "4", "-o", str(out)]) == 0
    row = {r.path: r for r in registered_runs()}[out]
    assert (row.kind, row.state, row.step, row.best["metric"]) == ("sft", "done", 12, "val_loss")
    capsys.readouterr()
    assert run_cli(["runs", "list"]) == 0
    listing = capsys.readouterr().out
    assert "folder" in listing and "chat.jsonl" in listing and "val loss" in listing
    assert run_cli(["export", str(out), "--to", "gguf-lora", "--no-llamacpp"]) == 0
    assert f"exporting the best checkpoint, step {row.best['step']}" in capsys.readouterr().err
    shutil.rmtree(out)
    assert run_cli(["runs", "list"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("folder "))
    assert line.endswith("missing")
