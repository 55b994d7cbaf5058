"""Real-size MoE rows (issue 20): OLMoE-1B-7B and Qwen3-30B-A3B shapes with 1-2 layers built,
measured per layer and projected to the whole model.

    python -m bench moe-shapes [--models olmoe,qwen3] [--layers 1,2] [--ctx 1024] [--steps 2]
                               [--cache default,0] [--precision fp32,bf16] [--json PATH]
    python -m bench.moe_shapes row --model olmoe --layers 2 --ctx 1024 [--weight-cache-mb 0]

Models (written once into bench/models/, gitignored, by app.engine's GGUF writer with the
metadata of app.engine.model.new_model; synthetic N(0, 0.02) weights, a synthetic vocabulary of
the real size so the loss head counts):

    olmoe-L   olmoe,    width 2048, 16 heads,              64 experts top-8, FFN 1024, vocab 50,304
    qwen3-L   qwen3moe, width 2048, 32 heads / 4 kv (128), 128 experts top-8, FFN 768, vocab 151,936

in Q4_K_M as llama-quantize lays it out for these layer counts: Q6_K for the output head,
attn_v and ffn_down_exps (its `use_more_bits` holds for every layer of a 1-2 layer model), Q4_K
for every other 2-D/3-D weight, F32 for the router and the norms. The quantizers are the bench's
own (bench.models.quantize_q4_k, quantize_q6_k here: plain min/max, not llama-quantize's
search); the engine's io.gguf.quantize cannot write K-quants.

Each row runs in its own process (`row`), so its peak RSS is its own: LoRA rank 16 on
attention, experts and router, the expert rank TrainConfig's default (min(16, 8) = 8 with more
than 32 experts), AdamW, one window of ctx random tokens per step. Per layer = step(2 layers) -
step(1 layer); whole model = step(1) + (L - 1) x per layer (L = 16 or 48), the same for peak RSS
(without the weight cache) and for the estimate (app.engine.training.memory.estimate_memory).
With several precisions (--precision fp32,bf16: TrainConfig.precision, issue 30) every row runs in
each, and the table ends with each configuration's peak RSS per precision beside float32's
(issue 30 asks of bf16 a peak no higher than float32's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from bench.models import MODELS, quantize_q4_k

Q4_K, Q6_K, F32 = 12, 14, 0
SHAPES = {
    "olmoe": dict(arch="olmoe", n_embd=2048, n_head=16, n_head_kv=16, head_dim=128, n_ff=1024,
                  n_expert=64, n_expert_used=8, n_vocab=50304, full_layers=16),
    "qwen3": dict(arch="qwen3moe", n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_ff=768,
                  n_expert=128, n_expert_used=8, n_vocab=151936, full_layers=48),
}
Q6_K_KINDS = ("output", "attn_v", "ffn_down_exps")
TARGETS = ("attention", "experts", "router")
RANK = 16


# ---- the model files -------------------------------------------------------------------------

def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Float values (..., n), n a multiple of 256 -> Q6_K raw rows (..., n / 256 * 210) uint8.

    16 sub-blocks of 16 with x = d·sc·(q - 32), q in 0..63, int8 sc: per sub-block the scale
    max|x| / 31.5 and d = max scale / 127. Layout: 128 bytes of low nibbles | 64 bytes of high
    2 bits | 16 int8 scales | fp16 d (value 128h + 32k + j: low nibble k//2 of ql[64h + 32(k%2)
    + j], bits 2k..2k+1 of qh[32h + j]).
    """
    *lead, n = x.shape
    blocks = np.asarray(x, np.float32).reshape(-1, 16, 16)                  # (B, 16, 16)
    step = np.abs(blocks).max(-1) / 31.5                                    # (B, 16)
    d = (step.max(-1) / 127.0).astype(np.float16)                           # (B,)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(step, d32, out=np.zeros_like(step), where=d32 > 0)), -127, 127)
    scale = (d32 * sc)[..., None]                                           # (B, 16, 1)
    q = np.divide(blocks, scale, out=np.zeros_like(blocks), where=scale != 0)
    q = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # (B, h, k, j)
    out = np.empty((blocks.shape[0], 210), np.uint8)                        # (B, 210)
    lo, hi = q & 15, q >> 4
    ql = out[:, :128].reshape(-1, 2, 2, 32)                                 # (B, h, k%2, j)
    ql[...] = lo[:, :, 0:2] | (lo[:, :, 2:4] << 4)
    out[:, 128:192].reshape(-1, 2, 32)[...] = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4)
                                               | (hi[:, :, 3] << 6))
    out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    out[:, 208:210] = d.view(np.uint8).reshape(-1, 2)
    return out.reshape(*lead, n // 256 * 210)


def _tokenizer(n_vocab: int) -> dict:
    """A synthetic gpt2-type vocabulary of n_vocab tokens (the bench feeds random token ids)."""
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": [f"<t{i}>" for i in range(n_vocab)],
            "tokenizer.ggml.token_type": np.ones(n_vocab, np.int32),
            "tokenizer.ggml.merges": ["<t2> <t3>"], "tokenizer.ggml.bos_token_id": 0,
            "tokenizer.ggml.eos_token_id": 1}


def _random_quantized(shape: tuple[int, ...], ggml_type: int, std: float, rng) -> np.ndarray:
    """N(0, std) values of `shape` quantized to ggml_type, made 16M values at a time."""
    quantizer = quantize_q6_k if ggml_type == Q6_K else quantize_q4_k
    rows = int(np.prod(shape[:-1]))
    flat = np.empty((rows, shape[-1] // 256 * (210 if ggml_type == Q6_K else 144)), np.uint8)
    step = max(1, (16 << 20) // shape[-1])
    for lo in range(0, rows, step):
        x = rng.standard_normal((min(step, rows - lo), shape[-1]), dtype=np.float32)
        x *= std
        flat[lo:lo + step] = quantizer(x)
    return flat.reshape(*shape[:-1], -1)


def model_path(name: str, n_layer: int) -> Path:
    """bench/models/<name>-<n_layer>L-q4_k_m.gguf, written on first use."""
    path = MODELS / f"{name}-{n_layer}L-q4_k_m.gguf"
    if path.exists():
        return path
    from app.engine.io.gguf import write_gguf
    from app.engine.model.config import config_from_metadata
    from app.engine.model.lora import tensor_kind
    from app.engine.model.new_model import NewModelSpec, _metadata
    from app.engine.model.transformer import expected_shapes

    s = SHAPES[name]
    spec = NewModelSpec(arch=s["arch"], n_layer=n_layer, n_embd=s["n_embd"], n_head=s["n_head"],
                        n_head_kv=s["n_head_kv"], n_ff=s["n_ff"], n_expert=s["n_expert"],
                        n_expert_used=s["n_expert_used"], context_length=4096, name=path.stem)
    meta = _metadata(spec, _tokenizer(s["n_vocab"]))
    meta[f"{s['arch']}.attention.key_length"] = meta[f"{s['arch']}.attention.value_length"] = s["head_dim"]
    cfg = config_from_metadata(meta, ["token_embd.weight", "output.weight"])
    rng = np.random.default_rng(0)
    tensors = {}
    for tname, shape in expected_shapes(cfg).items():
        kind = tensor_kind(tname)
        if len(shape) < 2 or kind == "ffn_gate_inp":
            value = np.ones(shape, np.float32) if "norm" in tname else (
                rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02))
            tensors[tname] = (value, F32)
        else:
            ggml_type = Q6_K if kind in Q6_K_KINDS else Q4_K
            tensors[tname] = (_random_quantized(shape, ggml_type, 0.02, rng), ggml_type)
    MODELS.mkdir(parents=True, exist_ok=True)
    write_gguf(path, meta, tensors)
    return path


# ---- one row, in its own process -------------------------------------------------------------

def _workload_type():
    from bench.train import Workload

    @dataclass(frozen=True)
    class MoeWorkload(Workload):
        """bench.train's Workload with the expert rank (None: TrainConfig's default)."""
        expert_rank: int | None = None

        def train_config(self):
            return replace(super().train_config(), expert_rank=self.expert_rank)

        def lora_config(self):
            return replace(super().lora_config(), expert_rank=self.expert_rank)

    return MoeWorkload


class ParallelClock:
    """Wall time inside the engine's parallel sections, per training step.

    Every module's reference to app.engine.runtime.parallel.parallel_map (and the one
    parallel.matmul calls) is swapped for a timed wrapper; a section counts when it really runs
    on the threads (not nested, more than one piece, more than one thread). The serial fraction
    of a step is 1 - inside / step."""

    def __init__(self):
        import app.engine.model.transformer  # noqa: F401 - loads the kernels that hold references
        from app.engine.runtime import parallel

        self.inside, self.steps = 0.0, []
        original = parallel.parallel_map

        def timed(fn, items, xp=np):
            items = list(items)
            if parallel._serial(xp, len(items)):
                return original(fn, items, xp)
            t0 = time.perf_counter()
            try:
                return original(fn, items, xp)
            finally:
                self.inside += time.perf_counter() - t0
        for module in list(sys.modules.values()):
            if getattr(module, "parallel_map", None) is original:
                module.parallel_map = timed

    def wrap_step(self, trainer_type) -> None:
        """Record (step seconds, seconds inside parallel sections) for each step."""
        step = trainer_type.step

        def timed_step(trainer, batch):
            inside0, t0 = self.inside, time.perf_counter()
            loss = step(trainer, batch)
            self.steps.append((time.perf_counter() - t0, self.inside - inside0))
            return loss
        trainer_type.step = timed_step


def row(name: str, n_layer: int, ctx: int, steps: int, cache_mb: int | None,
        expert_rank: int | None = None, precision: str = "fp32") -> dict:
    """One timed configuration (bench.train.run), the serial fraction of its timed steps and
    the memory estimate of the run."""
    from bench.train import WARMUP, EngineTrainer, run

    path = model_path(name, n_layer)
    w = _workload_type()(str(path), "lora", RANK, TARGETS, ctx, steps, 0, cache_mb,
                         precision=precision, expert_rank=expert_rank)
    clock = ParallelClock()
    clock.wrap_step(EngineTrainer)
    out = run(w)
    timed = clock.steps[WARMUP:]
    out["serial_fraction"] = 1 - sum(i for _, i in timed) / sum(s for s, _ in timed)
    out["estimate_mb"] = estimate_mb(path, w) / 2**20
    out["n_layer"] = n_layer
    return out


def estimate_mb(path: Path, w) -> int:
    """app.engine.training.memory's estimate for this workload, in bytes."""
    from app.engine.model.card import describe_model
    from app.engine.training.memory import estimate_memory

    card = describe_model(path, RANK, w.ctx, expert_rank=w.expert_rank,
                          targets=tuple(w.lora_config().kinds()))
    return estimate_memory(card, card.lora_params, weight_cache_mb=w.weight_cache_mb,
                           precision=w.precision).total


# ---- the table ---------------------------------------------------------------------------------

def _run_row(name: str, n_layer: int, ctx: int, steps: int, cache: str,
             precision: str = "fp32") -> dict:
    cmd = [sys.executable, "-m", "bench.moe_shapes", "row", "--model", name, "--layers",
           str(n_layer), "--ctx", str(ctx), "--steps", str(steps), "--precision", precision]
    if cache != "default":
        cmd += ["--weight-cache-mb", cache]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def project(rows: dict[int, dict], full_layers: int, memory: bool) -> dict:
    """Per layer = value(2) - value(1); whole model = value(1) + (L - 1) x per layer. Memory
    only without the weight cache: a cache grows per layer only until its budget is full."""
    out = {}
    for key in ("step_ms", "peak_rss_mb", "estimate_mb")[:3 if memory else 1]:
        per = rows[2][key] - rows[1][key]
        out[key] = {"per_layer": per, "whole": rows[1][key] + (full_layers - 1) * per}
    return out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m bench.moe_shapes", description=__doc__.splitlines()[0])
    if argv[:1] == ["row"]:
        p.add_argument("--model", choices=tuple(SHAPES), required=True)
        p.add_argument("--layers", type=int, default=1)
        p.add_argument("--ctx", type=int, default=1024)
        p.add_argument("--steps", type=int, default=2)
        p.add_argument("--weight-cache-mb", type=int)
        p.add_argument("--expert-rank", type=int)
        p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "auto"))
        a = p.parse_args(argv[1:])
        print(json.dumps(row(a.model, a.layers, a.ctx, a.steps, a.weight_cache_mb, a.expert_rank,
                             a.precision)))
        return
    p.add_argument("--models", default="olmoe,qwen3")
    p.add_argument("--layers", default="1,2")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--cache", default="default,0", help="weight cache MB per row: default and/or N")
    p.add_argument("--json", help="write every row here")
    p.add_argument("--precision", default="fp32",
                   help="TrainConfig.precision of the rows, one or several: fp32,bf16 (issue 30)")
    a = p.parse_args(argv)
    precisions = a.precision.split(",")
    for precision in precisions:
        if precision not in ("fp32", "bf16", "auto"):
            p.error(f"--precision: fp32, bf16 or auto (comma-separated), not {precision!r}")
    results, peaks = [], {}          # peaks: (model, cache, layers or "whole") -> {precision: MB}
    print(f"{'model':<8}{'prec':>5}{'layers':>7}{'cache':>8}{'s/step':>8}{'tok/s':>7}"
          f"{'dequant s':>10}{'serial':>7}{'peak GB':>8}{'est GB':>8}")
    for name in a.models.split(","):
        for cache in a.cache.split(","):
            for precision in precisions:
                _rows(a, name, cache, precision, results, peaks)
    if len(precisions) > 1:
        print(peak_lines(peaks, precisions), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


def peak_lines(peaks: dict, precisions: list[str]) -> str:
    """Each configuration's peak RSS per precision, and each precision's against the first's."""
    lines = ["peak RSS per precision (GB):"]
    for (name, cache, layers), by in peaks.items():
        base = by[precisions[0]]
        words = ", ".join(f"{p} {by[p] / 1024:.2f}" + (f" ({by[p] / base:.2f}x)" if i else "")
                          for i, p in enumerate(precisions))
        what = f"x{layers} layers" if isinstance(layers, int) else "whole model, projected"
        lines.append(f"  {name} {what}, cache {cache}: {words}")
    return "\n".join(lines)


def _rows(a, name: str, cache: str, precision: str, results: list, peaks: dict) -> None:
    """The rows of one model, cache and precision, printed, with their projection."""
    rows = {}
    for n_layer in (int(x) for x in a.layers.split(",")):
        r = rows[n_layer] = _run_row(name, n_layer, a.ctx, a.steps, cache, precision)
        r["precision"] = precision
        results.append(r)
        peaks.setdefault((name, cache, n_layer), {})[precision] = r["peak_rss_mb"]
        print(f"{name:<8}{precision:>5}{n_layer:>7}{cache:>8}{r['step_ms'] / 1e3:8.2f}"
              f"{r['tokens_per_s']:7.0f}{r['phase_ms']['dequant'] / 1e3:10.2f}"
              f"{r['serial_fraction']:7.0%}"
              f"{r['peak_rss_mb'] / 1024:8.2f}{r['estimate_mb'] / 1024:8.2f}", flush=True)
    if {1, 2} <= set(rows):
        pr = project(rows, SHAPES[name]["full_layers"], cache == "0")
        results.append({"model": name, "cache": cache, "precision": precision,
                        "projection": pr})
        line = (f"  {name} {precision} x{SHAPES[name]['full_layers']} layers, cache {cache}: "
                f"per layer {pr['step_ms']['per_layer'] / 1e3:.2f} s, whole step "
                f"{pr['step_ms']['whole'] / 1e3:.1f} s")
        if "peak_rss_mb" in pr:
            line += (f"; peak {pr['peak_rss_mb']['whole'] / 1024:.1f} GB (per layer "
                     f"{pr['peak_rss_mb']['per_layer']:.0f} MB), estimate "
                     f"{pr['estimate_mb']['whole'] / 1024:.1f} GB")
            peaks.setdefault((name, cache, "whole"), {})[precision] = \
                pr["peak_rss_mb"]["whole"]
        print(line, flush=True)


if __name__ == "__main__":
    main()
