"""The sweep behind the training defaults (issue 21): ``python -m bench.defaults_sweep``.

    python -m bench.defaults_sweep [--data chat|completions] [--epochs N] [--only NAME,...]
                                   [--model M.gguf] [--steps N] [--out results.jsonl]

Trains the README's first run (sample_data/tiny-moe.gguf, LoRA on attention, experts and router,
a 10% validation split, context 256, 3 epochs) at LoRA rank 4, 16 and 64 under a few
learning-rate settings, and prints one Markdown row per run: the validation loss at the end,
the best one and its step, and how far the end is above the best ("regret"). Every setting is
written out here, so the table does not move when TrainConfig's defaults do.

The settings ("recipes"):
  window-old   constant 5e-3, no warmup, no clipping (the window's defaults before issue 21)
  cli-old      constant 1e-4, no warmup, no clipping (the CLI's)
  cosine-LR    cosine to 0 after a linear warmup over 5% of the steps, global-norm clipping at
               1.0, learning rate LR
Alpha is 16 at every rank unless a row says otherwise (alpha=2r: alpha twice the rank; x16/128:
the learning rate scaled by 16/alpha, to test whether lr * alpha sets the update's size).

--model, --steps and --targets run a few points on another model (Gemma 3 270M: slow, use few
steps; it is dense: --targets attention).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_data"
TARGETS = ("attention", "experts", "router")


def recipes() -> dict[str, dict]:
    """name -> (rank, alpha, TrainConfig fields) of each run."""
    old = {"window-old": dict(lr=5e-3, schedule="constant"),
           "cli-old": dict(lr=1e-4, schedule="constant")}
    new = {f"cosine-{name}": dict(lr=float(name), schedule="cosine", warmup=0.05,
                                  max_grad_norm=1.0) for name in ("1e-2", "5e-3", "2e-3", "1e-3")}
    runs = {}
    for rank in (4, 16, 64):
        for name, fields in {**old, **new}.items():
            runs[f"r{rank} {name}"] = dict(rank=rank, alpha=16.0, **fields)
    for rank in (16, 64):               # alpha twice the rank
        for lr in ("5e-3", "2e-3"):
            runs[f"r{rank} alpha=2r cosine-{lr}"] = dict(rank=rank, alpha=2.0 * rank,
                                                         **new[f"cosine-{lr}"])
    # the learning rate scaled by 16 / alpha: does lr * alpha set the update's size?
    runs["r64 alpha=2r cosine-2e-3x16/128"] = dict(rank=64, alpha=128.0,
                                                    **{**new["cosine-2e-3"], "lr": 2e-3 / 8})
    return runs


def run_one(model: str, data: str, recipe: dict, epochs: int, max_steps: int,
            eval_every: int, targets: tuple[str, ...]) -> dict:
    from app.engine.data.dataset import DataConfig
    from app.engine.training.config import TrainConfig
    from app.engine.training.sft import RunConfig, train

    events: list[dict] = []
    # the schedule's length decides the warmup steps: a dry count of the run's steps first
    config = RunConfig(model=model, data=data, epochs=epochs, max_steps=max_steps,
                       eval_every=eval_every,
                       data_config=DataConfig(context=256, val_fraction=0.1),
                       train=TrainConfig(lora_rank=recipe["rank"], lora_alpha=recipe["alpha"],
                                         lora_targets=targets, lr=recipe["lr"],
                                         schedule=recipe["schedule"],
                                         max_grad_norm=recipe.get("max_grad_norm", 0.0),
                                         gclip=0.0, weight_decay=0.0, seed=0))
    total = _total_steps(config)
    warmup = round(recipe.get("warmup", 0.0) * total)
    config = dataclasses.replace(config, train=dataclasses.replace(config.train,
                                                                   warmup_steps=warmup))
    t0 = time.perf_counter()
    train(config, events.append, lambda: None, None)
    evals = [(e["step"], e["loss"]) for e in events if e.get("type") == "eval"]
    steps = [e for e in events if e.get("type") == "step"]
    best_step, best = min(evals, key=lambda s: s[1])
    final = evals[-1][1]
    return {"steps": total, "warmup": warmup, "final_val": final, "best_val": best,
            "best_step": best_step, "regret": final - best,
            "last_train_loss": steps[-1]["loss"] if steps else math.nan,
            "seconds": round(time.perf_counter() - t0, 1)}


def _total_steps(config) -> int:
    from app.engine.data.dataset import load_dataset
    from app.engine.model.transformer import load_model

    model = load_model(config.model)
    dataset = load_dataset(config.data, model.tokenizer, config.data_config)
    total = config.epochs * dataset.steps_per_epoch(config.train.grad_accum)
    return min(total, config.max_steps) if config.max_steps else total


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="chat", help="chat or completions (sample_data/*.jsonl)")
    p.add_argument("--model", default=str(SAMPLE / "tiny-moe.gguf"))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=0, help="cap on steps (0: none)")
    p.add_argument("--eval-every", type=int, default=15)
    p.add_argument("--only", help="comma list of recipe names (default: all)")
    p.add_argument("--targets", default=",".join(TARGETS),
                   help="LoRA targets (a dense model: attention)")
    p.add_argument("--out", help="append each result as a JSON line to this file")
    args = p.parse_args(argv)
    data = str(SAMPLE / f"{args.data}.jsonl")
    chosen = recipes()
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    print(f"model {Path(args.model).name}, data {Path(data).name}, epochs {args.epochs}")
    print("| run | steps | final val | best val (step) | final - best | last train loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, recipe in chosen.items():
        r = run_one(args.model, data, recipe, args.epochs, args.steps, args.eval_every,
                    tuple(args.targets.split(",")))
        print(f"| {name} | {r['steps']} | {r['final_val']:.3f} | {r['best_val']:.3f} "
              f"({r['best_step']}) | {r['regret']:.3f} | {r['last_train_loss']:.3f} |",
              flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({"run": name, "data": args.data, "model": Path(args.model).name,
                                    **recipe, **r}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
