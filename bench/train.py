"""Training-step speed and memory.

    python -m bench.train                      the whole table (each row in its own process)
    python -m bench.train --model M.gguf --mode lora|full [--rank R] [--targets a,b]
                          [--ctx C] [--steps N] [--checkpoint N] [--json]
                                               one configuration, one JSON object

Figures per configuration: median tokens/s and step time of a full training step (forward,
loss, backward, optimizer), peak resident memory of the process, and the time split into
forward, backward (incl. recompute), optimizer and dequantization. The synthetic models
(llama, width 512, 4 layers, 8 heads / 4 kv heads; dense FFN 1536 or 8 experts top-2 with
expert FFN 1024; 259-token byte vocabulary) are written once to bench/models/ with the
project's own GGUF writer. Medians over `steps` timed steps after one warm-up step.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "bench" / "models"
BYTE_VOCAB = ROOT / "tests" / "data" / "golden" / "llama-f32.gguf"

BENCH_MODELS = {
    "bench-dense": dict(arch="llama", n_layer=4, n_embd=512, n_head=8, n_head_kv=4, n_ff=1536),
    "bench-moe": dict(arch="llama", n_layer=4, n_embd=512, n_head=8, n_head_kv=4, n_ff=1024,
                      n_expert=8, n_expert_used=2),
}
TABLE = [  # (model, mode, rank, targets, ctx, checkpoint interval)
    ("bench-moe", "lora", 16, "attention,experts", 256, 0),
    ("bench-dense", "lora", 16, "attention,ffn", 256, 0),
    ("bench-dense", "full", 0, "", 256, 0),
    ("bench-moe", "lora", 16, "attention,experts", 256, 1),
    ("bench-dense", "full", 0, "", 256, 1),
]


def bench_model(name: str) -> Path:
    from app.engine.new_model import NewModelSpec, create_model

    path = MODELS / f"{name}.gguf"
    if not path.exists():
        MODELS.mkdir(parents=True, exist_ok=True)
        create_model(path, NewModelSpec(**BENCH_MODELS[name], context_length=1024, seed=0,
                                        name=name), BYTE_VOCAB)
    return path


def run_one(model_path: str, mode: str, rank: int, targets: str, ctx: int, steps: int,
            checkpoint: int) -> dict:
    from app.engine import load_model
    from app.engine.config import TrainConfig
    from app.engine.train import Batch, TrainSession

    model = load_model(model_path)
    config = TrainConfig(mode=mode, lora_rank=max(rank, 1), lora_alpha=2.0 * max(rank, 1),
                         lora_targets=tuple(t for t in targets.split(",") if t) or ("attention",),
                         lr=1e-4, max_steps=steps + 1, checkpoint_interval=checkpoint)
    session = TrainSession(model, config)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.config.n_vocab, ctx)
    batch = Batch(tokens, np.roll(tokens, -1))
    session.step([batch])                                       # warm-up (fills the caches)
    forward, total, optim, dequant = [], [], [], []
    for _ in range(steps):
        d0 = model.weights.dequant_seconds
        t0 = time.perf_counter()
        session.model.loss(session.params, batch.tokens, batch.labels)
        t1 = time.perf_counter()
        grads = session._accumulate([batch]).grads
        t2 = time.perf_counter()
        session.optimizer.step(grads)
        t3 = time.perf_counter()
        forward.append(t1 - t0)
        total.append(t3 - t1)
        optim.append(t3 - t2)
        dequant.append(model.weights.dequant_seconds - d0)
    step = statistics.median(total)
    fwd, opt = statistics.median(forward), statistics.median(optim)
    return {"model": Path(model_path).stem, "mode": mode, "rank": rank, "targets": targets,
            "ctx": ctx, "checkpoint": checkpoint, "trainable": session.n_trainable,
            "tokens_per_s": ctx / step, "step_ms": step * 1e3,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "phase_ms": {"forward": fwd * 1e3, "backward": (step - fwd - opt) * 1e3,
                         "optimizer": opt * 1e3,
                         "dequant": statistics.median(dequant) * 1e3}}


def table(steps: int) -> None:
    header = (f"{'model':<12} {'mode':<5} {'targets':<18} {'ckpt':>4} {'trainable':>10} "
              f"{'tok/s':>7} {'step ms':>8} {'fwd':>6} {'bwd':>6} {'opt':>5} {'deq':>5} {'RSS MB':>7}")
    print(header)
    for name, mode, rank, targets, ctx, ckpt in TABLE:
        path = bench_model(name)
        cmd = [sys.executable, "-m", "bench.train", "--model", str(path), "--mode", mode,
               "--rank", str(rank), "--targets", targets, "--ctx", str(ctx), "--steps",
               str(steps), "--checkpoint", str(ckpt), "--json"]
        row = json.loads(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                        check=True).stdout)
        p = row["phase_ms"]
        print(f"{name:<12} {mode:<5} {targets or 'all':<18} {ckpt:>4} {row['trainable']:>10,} "
              f"{row['tokens_per_s']:>7.0f} {row['step_ms']:>8.0f} {p['forward']:>6.0f} "
              f"{p['backward']:>6.0f} {p['optimizer']:>5.0f} {p['dequant']:>5.1f} "
              f"{row['peak_rss_mb']:>7.0f}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--mode", default="lora", choices=("lora", "full"))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="attention,experts,ffn")
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--checkpoint", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.model is None:
        table(args.steps)
        return
    row = run_one(args.model, args.mode, args.rank, args.targets, args.ctx, args.steps,
                  args.checkpoint)
    print(json.dumps(row) if args.json else json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
