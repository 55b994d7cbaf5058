"""One training configuration, timed: ``python -m bench train`` (``python -m bench.train`` is the
same command).

    python -m bench train --model M.gguf|NAME --mode lora|full [--rank R] [--targets a,b]
                          [--ctx C] [--steps N] [--checkpoint N] [--impl ours|torch|llama.cpp]
                          [--device cpu|cuda] [--precision fp32|bf16|auto] [--json]

prints one JSON object. NAME is a model of bench/models.py (e.g. bench-moe-q8_0, gemma3-270m).
--impl: ours (app.engine's TrainSession), torch (the PyTorch peer, bench/torch_peer.py) or
llama.cpp (llama-finetune, bench/llamacpp.py).
--precision (default fp32, the table's rows so far): ours' TrainConfig.precision (the frozen
base's products in bf16: app/engine/runtime/bf16.py; auto as a run resolves it); the peer's
bf16 is torch.autocast("cpu", dtype=torch.bfloat16) around its forward and loss, as a PyTorch
user on such a CPU would run it (auto: the peer autocasts where ours would choose bf16). The
row says what ran ("precision_used", ours' reason in "precision_reason").

The step, identical on every side: one sequence of C random token ids (fixed seed) with the
next token as label; AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8, no weight decay) after
global-norm gradient clipping at 1.0 (TrainConfig's default is no clipping: the bench turns it
on for both sides); LoRA alpha = 2 x rank, the adapter made by app.engine.model.lora.init_adapter
with the same seed; full fine-tuning trains every F32/F16/BF16 tensor.

Timing: WARMUP untimed steps (they fill the caches and let the allocator settle; the first
one's loss is `loss0`, the loss at the initial weights, equal on both sides), then N timed
steps. A step's time ("step_ms") is the batch
construction plus the training step. Its phases come from app.engine.runtime.timing's PhaseClock:
data (building the batch from the token window), forward, loss (ours: output norm, head and
cross-entropy, forward and backward; the peer: head and cross-entropy forward, its backward
being in "backward"), backward, recompute (ours: the blocks re-run under checkpointing; the
peer's recompute happens inside autograd's backward), optimizer (with the clipping), dequant
(inside the other phases: WeightStore.dequant_seconds) and other (the step minus its phases).
Every figure is the median over the timed steps; tokens/s = C / median step.

Peak RSS is the process's high-water mark (ru_maxrss) right after the timed steps, so it
includes the interpreter and libraries ("startup_rss_mb", the RSS before the model is loaded).
Beside it: the matmul FLOPs of the step, the achieved GFLOP/s and the memory lower bound of
bench/cost.py. The torch peer computes its logits on the first window before training and,
after the timing, compares them with Model.logits of ours; when they differ by more than
LOGITS_RTOL of the largest logit its timing figures are withheld ("refused").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from app.engine.runtime.backend import peak_rss_mb
from app.engine.training.config import TrainConfig
from app.engine.runtime.timing import PhaseClock, phase

LR, MAX_GRAD_NORM, SEED = 1e-4, 1.0, 0
WARMUP = 2   # untimed steps: torch's 2nd step is still ~2x its steady state (allocator, first use)
STEPS = 5    # timed steps by default
LOGITS_RTOL = 1e-4
IMPLS = ("ours", "torch", "llama.cpp")
PHASES = ("data", "forward", "loss", "backward", "recompute", "optimizer")


@dataclass(frozen=True)
class Workload:
    model: str                      # path of the GGUF file
    mode: str = "lora"
    rank: int = 16
    targets: tuple[str, ...] = ("attention", "ffn", "experts")
    ctx: int = 256
    steps: int = 5
    checkpoint: int = 0
    weight_cache_mb: int | None = None   # the engine's dequantized-weight cache (None: default)
    precision: str = "fp32"              # TrainConfig.precision; the peer's autocast (above)

    def train_config(self) -> TrainConfig:
        return TrainConfig(mode=self.mode, lora_rank=self.rank, lora_alpha=2.0 * self.rank,
                           lora_targets=self.targets, lr=LR, max_grad_norm=MAX_GRAD_NORM,
                           max_steps=WARMUP + self.steps, checkpoint_interval=self.checkpoint,
                           seed=SEED, precision=self.precision)

    def lora_config(self):
        """The LoraConfig TrainSession builds its adapter from (the peer builds the same one)."""
        from app.engine.model.lora import LoraConfig

        c = self.train_config()
        return LoraConfig(c.lora_rank, c.lora_alpha, c.lora_targets, c.rslora, c.seed)

    def windows(self, n_vocab: int) -> np.ndarray:
        """Token windows (WARMUP + steps, ctx + 1): tokens = window[:-1], labels = window[1:]."""
        rng = np.random.default_rng(SEED)
        return rng.integers(0, n_vocab, (WARMUP + self.steps, self.ctx + 1), dtype=np.int64)


class Unsupported(Exception):
    """An implementation cannot run this model or configuration (the row says why)."""


def threads() -> int:
    """Threads for every implementation: the engine's count (WORKBENCH_THREADS, else the cores
    this process may run on); the peer gets the same number."""
    from app.engine.runtime.parallel import thread_count

    return thread_count()


class EngineTrainer:
    """Ours: app.engine's TrainSession on the memory-mapped model."""

    def __init__(self, w: Workload, device: str = "cpu"):
        from dataclasses import replace

        from app.engine import load_model
        from app.engine.training.session import TrainSession

        budget = None if w.weight_cache_mb is None else w.weight_cache_mb << 20
        self.model = load_model(w.model, cache_budget=budget, device=device)
        self.session = TrainSession(self.model, replace(w.train_config(), device=device))
        self.n_trainable = self.session.n_trainable
        self.n_vocab = self.model.config.n_vocab
        self.precision = self.session.precision

    @property
    def dequant_seconds(self) -> float:
        return self.model.weights.dequant_seconds

    def batch(self, window: np.ndarray):
        from app.engine.data.batches import Batch

        return Batch(window[:-1], window[1:])

    def step(self, batch) -> float:
        return self.session.step([batch]).loss


def measure(trainer, windows: np.ndarray) -> dict:
    """Run the warm-up and the timed steps; medians per step and per phase (ms)."""
    totals, phases, losses = [], [], []
    for window in windows:
        d0 = trainer.dequant_seconds
        with PhaseClock() as clock:
            t0 = time.perf_counter()
            with phase("data"):
                batch = trainer.batch(window)
            losses.append(trainer.step(batch))
            totals.append(time.perf_counter() - t0)
        phases.append({**clock.seconds, "dequant": trainer.dequant_seconds - d0})
    peak = peak_rss_mb()
    warmup = [t * 1e3 for t in totals[:WARMUP]]   # the first pays the compiled kernels' load
    totals, phases = totals[WARMUP:], phases[WARMUP:]
    step = statistics.median(totals)
    ms = lambda values: statistics.median(values) * 1e3
    phase_ms = {name: ms([p.get(name, 0.0) for p in phases]) for name in (*PHASES, "dequant")}
    phase_ms["other"] = ms([t - sum(p.get(n, 0.0) for n in PHASES) for t, p in zip(totals, phases)])
    return {"tokens_per_s": (windows.shape[1] - 1) / step, "step_ms": step * 1e3,
            "step_ms_each": [t * 1e3 for t in totals], "warmup_ms": warmup, "phase_ms": phase_ms,
            "loss0": losses[0], "peak_rss_mb": peak}


def costs(w: Workload, n_trainable: int, step_ms: float, peak_mb: float) -> dict:
    """FLOPs, achieved GFLOP/s and the memory lower bound of the step (bench/cost.py)."""
    from app.engine.model.config import config_from_metadata
    from app.engine.io.gguf import read_gguf
    from app.engine.model.lora import lora_targets
    from app.engine.model.params import TRAINABLE_TYPES
    from bench.cost import memory_bound, step_flops

    f = read_gguf(w.model)
    try:
        cfg = config_from_metadata(f.metadata, f.tensors)
        stored = sum(t.nbytes for t in f.tensors.values())
        if w.mode == "lora":
            shapes = {n: t.shape for n, t in f.tensors.items()}
            ranks, full = {n: w.rank for n in lora_targets(shapes, w.lora_config())}, set()
        else:
            ranks, full = {}, {n for n, t in f.tensors.items() if t.ggml_type in TRAINABLE_TYPES}
    finally:
        f.close()
    flops = step_flops(cfg, w.ctx, ranks, full, w.checkpoint)
    bound = memory_bound(cfg, w.ctx, stored, n_trainable, ranks, w.checkpoint,
                         w.train_config().vocab_chunk)
    return {"arch": cfg.arch, "flops": flops, "gflops_per_s": flops["total"] / step_ms / 1e6,
            "memory_bound_mb": {k: v / 2**20 for k, v in bound.items()},
            "rss_over_bound": peak_mb / (bound["total"] / 2**20)}


def compare_logits(peer_logits: np.ndarray, model_path: str, tokens: np.ndarray) -> dict:
    """Max |peer - ours| over the (T, V) logits, relative to the largest |logit| of ours."""
    from app.engine import load_model

    ours = load_model(model_path).logits(tokens, llamacpp_numerics=False)  # as both train
    diff = float(np.abs(peer_logits - ours).max())
    scale = float(np.abs(ours).max())
    return {"max_abs_diff": diff, "max_abs_logit": scale, "rel": diff / scale,
            "ok": diff <= LOGITS_RTOL * scale}


def device_unavailable(device: str, impl: str) -> str | None:
    """Why the device cannot run the bench, or None (cpu always can)."""
    if device == "cpu":
        return None
    if impl != "ours":
        return f"cuda: the {impl} peer runs on the CPU only"
    from app.engine.runtime.backend import gpu_available

    return None if gpu_available() else "cuda: not available (no CUDA device or CuPy)"


def run(w: Workload, impl: str = "ours", device: str = "cpu") -> dict:
    """Time one configuration with one implementation: the JSON row (module docstring)."""
    described = {"impl": impl, **asdict(w), "model": Path(w.model).stem, "model_path": w.model,
                 "targets": ",".join(w.targets) if w.mode == "lora" else "", "device": device,
                 "threads": threads()}
    reason = device_unavailable(device, impl)
    if reason:
        return {**described, "skipped": reason}
    if impl == "llama.cpp":
        from bench.llamacpp import run_finetune

        return {**described, **run_finetune(w, threads())}
    trainer_type = EngineTrainer
    if impl == "torch":
        from bench.torch_peer import TorchTrainer as trainer_type  # torch counts in startup
    startup = peak_rss_mb()                                        # interpreter and libraries
    try:
        trainer = trainer_type(w, device) if impl == "ours" else trainer_type(w)
    except Unsupported as e:
        return {**described, "skipped": str(e)}
    windows = w.windows(trainer.n_vocab)
    peer_logits = trainer.logits(windows[0, :-1]) if impl == "torch" else None
    row = {**described, "trainable": trainer.n_trainable, "startup_rss_mb": startup,
           "precision_used": trainer.precision.name,
           "precision_reason": trainer.precision.reason, **measure(trainer, windows)}
    row.update(costs(w, trainer.n_trainable, row["step_ms"], row["peak_rss_mb"]))
    if peer_logits is not None:
        row["logits_check"] = check = compare_logits(peer_logits, w.model, windows[0, :-1])
        if not check["ok"]:
            row.update(refused=f"logits differ from ours by {check['rel']:.1e} of the largest",
                       tokens_per_s=None, step_ms=None, gflops_per_s=None)
    return row


def workload_args(parser: argparse.ArgumentParser) -> None:
    """The options shared by `python -m bench train` and the table (`python -m bench`)."""
    parser.add_argument("--steps", type=int, help=f"timed steps after {WARMUP} warm-up steps")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--precision", default="fp32",
                        help="fp32, bf16 or auto (`python -m bench train`: one; the table: a "
                        "comma-separated list, each implementation run in each, e.g. fp32,bf16)")


def main(argv=None) -> None:
    from bench.models import NAMES, model_path

    parser = argparse.ArgumentParser(prog="python -m bench train",
                                     description="Time one training configuration.")
    parser.add_argument("--model", required=True, help="a GGUF path or one of " + ", ".join(NAMES))
    parser.add_argument("--mode", default="lora", choices=("lora", "full"))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=",".join(Workload.targets), help="LoRA targets")
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--checkpoint", type=int, default=0, help="checkpoint interval (0: off)")
    parser.add_argument("--weight-cache-mb", type=int,
                        help="ours: cache of dequantized weights (default 40%% of RAM; 0: none)")
    parser.add_argument("--impl", default="ours", choices=IMPLS)
    parser.add_argument("--json", action="store_true", help="one line of JSON")
    workload_args(parser)
    args = parser.parse_args(argv)
    path = model_path(args.model) if args.model in NAMES else Path(args.model)
    if path is None:
        row = {"impl": args.impl, "model": args.model, "skipped": "model not installed"}
    else:
        targets = tuple(t for t in args.targets.split(",") if t)
        w = Workload(str(path), args.mode, args.rank, targets, args.ctx, args.steps or STEPS,
                     args.checkpoint, args.weight_cache_mb, args.precision)
        row = run(w, args.impl, args.device)
    print(json.dumps(row) if args.json else json.dumps(row, indent=2), flush=True)


if __name__ == "__main__":
    main()
