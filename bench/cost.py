"""What one training step must cost, from the model's shapes alone, and what the machine delivers.

**Matmul FLOPs of a step** (`step_flops`). Only matrix products count, 2·m·k·n for an
(m, k) @ (k, n) product; norms, RoPE, softmax, the MoE gather/scatter and the optimizer are not
counted. T = tokens, K = experts per token, R = LoRA rank, C = width, H heads of size D. A linear
layer in -> out over `rows` input rows (T; T·K for expert projections, summed over the experts):

    forward   2·rows·in·out                            + LoRA  2·rows·R·(in + out)
    backward  2·rows·in·out (dx, always computed)
              + 2·rows·in·out (dW, only when the weight is trained in full)
              + LoRA  4·rows·R·(in + out)              (dx through B then A, dA, dB)

Attention per layer: forward Q·K^T and P·V over the (query, key) pairs the engine computes,
2 · 2·H·P·D; backward 5 · 2·H·P·D (P recomputed from the saved log-sum-exp, then dV, dP, dQ,
dK). P is T² less what the causal mask lets it skip: each block of query rows reads the keys
up to its last row (`attention_pairs`, from the engine's own app.engine.kernels.attention
.attention_pieces), e.g. 0.75·T² at T = 256 and 0.56·T² at T = 1024 on bench-dense.

The output head (C -> vocabulary V) runs as a linear layer, counted under "loss". When the
head is trained (in full or with a LoRA), the engine's chunked cross-entropy computes the
logits a second time in backward (2·T·C·V, plus 2·T·R·V with a LoRA); a frozen head takes one
pass (app.engine.kernels.loss.cross_entropy_frozen_head). Gradient checkpointing (interval
> 0) runs the forward of every block a second time during backward: "recompute". This is
exactly what the engine computes; the PyTorch peer does less (no logit recompute; autograd
skips dx where nothing upstream needs it; SDPA skips the masked half).

**Memory lower bound** (`memory_bound`), bytes:

    weights as stored (the GGUF tensor data)
    + trainable parameters x 16 (float32 value, gradient and two AdamW moments)
    + activations kept for backward (app.engine.model.card.layer_activation_bytes: per token
      and layer, what attention, the FFN and the LoRA branches keep), all layers without
      checkpointing; with interval N the saved inputs of ceil(L/N) segments (C each) plus one
      segment of N layers alive during its backward; plus the residual stream and its
      gradient (2·T·C) (kept_activation_bytes)
    + one output-head chunk of logits, T x min(V, vocab_chunk).

Transient work buffers (attention probabilities, dequantized weight copies) are not in it: an
implementation can avoid them, so the bound stays a bound.

**Machine matmul rate** (`matmul_rates`): median GFLOP/s of NumPy float32 GEMMs (np.matmul on
the BLAS NumPy was built with), for a large square product and for the shapes the bench models
actually run.
"""

from __future__ import annotations

import statistics
import time
import numpy as np

from app.engine.model.config import ModelConfig
from app.engine.model.card import (Linear, block_linears, kept_activation_bytes,
                                   layer_activation_bytes)

F32 = 4  # bytes


def head_linear(cfg: ModelConfig, n_tokens: int) -> Linear:
    name = "token_embd.weight" if cfg.tied_output else "output.weight"
    return Linear(name, n_tokens, cfg.n_embd, cfg.n_vocab)


def linear_flops(lin: Linear, trained: bool, rank: int) -> tuple[int, int]:
    """(forward, backward) matmul FLOPs of one linear layer (module docstring)."""
    base = 2 * lin.rows * lin.n_in * lin.n_out
    lora = 2 * lin.rows * rank * (lin.n_in + lin.n_out)
    return base + lora, base * (2 if trained else 1) + 2 * lora


def attention_pairs(cfg: ModelConfig, il: int, n_tokens: int) -> int:
    """(query, key) pairs layer il's attention computes per head for n_tokens causal tokens
    (one sequence; a sliding-window layer skips the distant past as well)."""
    from app.engine.kernels.attention import attention_mask, attention_pieces

    window = cfg.sliding_window if cfg.swa_layers and cfg.swa_layers[il] else 0
    pos = np.arange(n_tokens)
    pieces, _ = attention_pieces(np, cfg.n_head_kv, attention_mask(np, pos, pos, window))
    return sum((rows.stop - rows.start) * (keys.stop - keys.start)
               for j, _, rows, keys in pieces if j == 0)


def step_flops(cfg: ModelConfig, n_tokens: int, ranks: dict[str, int], trained: set[str],
               checkpoint: int) -> dict[str, int]:
    """Matmul FLOPs of one training step: forward, backward and recompute of the blocks, loss
    (the output head's forward, backward and logit recompute) and their total.

    ranks: LoRA rank per adapted tensor name; trained: tensor names trained in full."""
    fwd = bwd = 0
    for il in range(cfg.n_layer):
        for lin in block_linears(cfg, il, n_tokens):
            f, b = linear_flops(lin, lin.name in trained, ranks.get(lin.name, 0))
            fwd, bwd = fwd + f, bwd + b
        attn = 2 * 2 * cfg.n_head * attention_pairs(cfg, il, n_tokens) * cfg.head_dim  # QK^T, PV
        fwd, bwd = fwd + attn, bwd + attn * 5 // 2
    head = head_linear(cfg, n_tokens)
    rank = 0 if cfg.tied_output else ranks.get(head.name, 0)
    f, b = linear_flops(head, head.name in trained, rank)
    recomputed = rank or head.name in trained                            # two passes, else one
    logits = 2 * head.rows * head.n_out * (head.n_in + rank) if recomputed else 0
    out = {"forward": fwd, "backward": bwd, "recompute": fwd if checkpoint else 0,
           "loss": f + b + logits}
    out["total"] = sum(out.values())
    return out


def memory_bound(cfg: ModelConfig, n_tokens: int, stored_bytes: int, n_trainable: int,
                 ranks: dict[str, int], checkpoint: int, vocab_chunk: int) -> dict[str, int]:
    """Lower bound in bytes of a training step's peak memory, by part (module docstring); the
    activations are app.engine.model.card's model, which New run's estimate uses too."""
    layers = layer_activation_bytes(cfg, n_tokens, ranks)
    boundary = n_tokens * cfg.n_embd * F32
    out = {"weights": stored_bytes, "trainable_and_optimizer": 16 * n_trainable,
           "activations": kept_activation_bytes(layers, boundary, checkpoint),
           "head_chunk": n_tokens * min(cfg.n_vocab, vocab_chunk) * F32}
    out["total"] = sum(out.values())
    return out


# ---- the machine --------------------------------------------------------------------------------

LARGE_GEMM = (2048, 2048, 2048)
MODEL_GEMMS = {  # (m, k, n) of the products the bench models run most
    "dense ffn (256x512)@(512x1536)": (256, 512, 1536),
    "expert (64x512)@(512x1024)": (64, 512, 1024),
    "weight grad (1536x256)@(256x512)": (1536, 256, 512),
    "lora (256x512)@(512x16)": (256, 512, 16),
}


def gemm_gflops(m: int, k: int, n: int, repeat: int) -> float:
    """Median GFLOP/s of a float32 (m, k) @ (k, n) product into a preallocated output."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    out = np.empty((m, n), np.float32)
    np.matmul(a, b, out=out)                                                        # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.matmul(a, b, out=out)
        times.append(time.perf_counter() - t0)
    return 2 * m * k * n / statistics.median(times) / 1e9


def matmul_rates(repeat: int = 7) -> dict:
    """{"large": GFLOP/s of LARGE_GEMM, "shapes": {label: GFLOP/s}}; small products repeat more."""
    return {"large": gemm_gflops(*LARGE_GEMM, repeat),
            "large_shape": "x".join(map(str, LARGE_GEMM)),
            "shapes": {label: gemm_gflops(*mkn, repeat * 10) for label, mkn in MODEL_GEMMS.items()}}
