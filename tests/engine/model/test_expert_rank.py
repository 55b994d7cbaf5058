"""Expert adapters' own rank (issue 20): LoraConfig.expert_rank_for, init_adapter, the card's
trainable count, TrainConfig's field and the CLI option."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.engine.errors import ConfigError
from app.engine.model.card import lora_param_count
from app.engine.model.lora import LoraConfig, init_adapter
from app.engine.training.config import TrainConfig

GOLDEN_MODEL = Path(__file__).resolve().parents[2] / "data" / "golden" / "llama-f32.gguf"


def _shapes(n_expert: int) -> dict[str, tuple[int, ...]]:
    return {"blk.0.attn_q.weight": (64, 64), "blk.0.ffn_gate_exps.weight": (n_expert, 32, 64),
            "blk.0.ffn_down_exps.weight": (n_expert, 64, 32)}


@pytest.mark.parametrize("n_expert, expert_rank, want", [(8, None, 16), (32, None, 16),
                                                         (64, None, 8), (128, None, 8),
                                                         (64, 4, 4), (8, 12, 12)])
def test_expert_rank_default_and_override(n_expert, expert_rank, want):
    config = LoraConfig(rank=16, targets=("attention", "experts"), expert_rank=expert_rank)
    assert config.expert_rank_for(n_expert) == want
    adapter = init_adapter(_shapes(n_expert), "llama", config)
    assert adapter.rank("blk.0.attn_q.weight") == 16
    for name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight"):
        a, b = adapter.tensors[name]
        assert a.shape[:2] == (n_expert, want) and b.shape[-1] == want
        assert adapter.scale(name) == adapter.alpha / want              # llama.cpp's alpha / R
    expected = 16 * 128 + n_expert * want * (96 + 96)
    assert lora_param_count(_shapes(n_expert), 16, ("attn_q", "ffn_gate_exps", "ffn_down_exps"),
                            expert_rank) == expected


def test_small_rank_is_not_raised_to_the_cap():
    assert LoraConfig(rank=4).expert_rank_for(128) == 4


def test_expert_rank_is_checked():
    with pytest.raises(ConfigError):
        LoraConfig(expert_rank=0).validate()
    with pytest.raises(ConfigError):
        TrainConfig.from_dict({"expert_rank": 0})
    assert TrainConfig.from_dict({"expert_rank": 4}).expert_rank == 4
    assert TrainConfig().expert_rank is None


def test_cli_option_reaches_the_train_config():
    from app.cli.grpo import grpo_config_from_args
    from app.cli.main import build_parser
    from app.cli.train import run_config_from_args

    parse = build_parser().parse_args
    model = str(GOLDEN_MODEL)
    args = parse(["train", "--model", model, "--data", "d.jsonl", "--expert-rank", "6"])
    assert run_config_from_args(args).train.expert_rank == 6
    args = parse(["grpo", "--model", model, "--prompts", "p.jsonl", "--reward", "exact",
                  "--expert-rank", "6"])
    assert grpo_config_from_args(args).train.expert_rank == 6
