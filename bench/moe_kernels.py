"""Forward + backward speed of the MoE expert block (app.engine.kernels.moe), float32.

Run from the repository root: ``python -m bench.moe_kernels [--tokens 256] [--width 512]
[--ffn 1024] [--experts 8] [--k 2] [--rank 16] [--repeat 5]``.

Phases, each the median of `repeat` timed runs after one warm-up: router (softmax, top-k,
renorm) + dispatch, expert forward (training path, LoRA on all three projections), combine,
combine backward, expert backward with frozen base weights (dx + LoRA grads: the QLoRA path),
expert backward with the full weight gradients as well (need_dw: the OUT_PROD_ID path) into
fresh arrays and into reused dw_out buffers, router backward; then the whole block timed as one
call, and a dense GEMM of the same shape as one projection over all slots as a reference for
what the machine delivers at that moment (BLAS collapses when other busy processes compete for
the cores; try OPENBLAS_NUM_THREADS=1 then). GFLOP/s counts only the matmul flops of a phase.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from app.engine.kernels.moe import (combine_backward, combine_forward, dispatch_order,
                                    experts_backward, experts_forward_train, router_backward,
                                    router_forward)


def _median_ms(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def run(t: int, c: int, f: int, e: int, k: int, r: int, repeat: int) -> list[tuple[str, float, float]]:
    rng = np.random.default_rng(0)
    f32 = np.float32
    x = rng.standard_normal((t, c), dtype=f32)
    logits = rng.standard_normal((t, e), dtype=f32)
    w_gate = rng.standard_normal((e, f, c), dtype=f32) / np.sqrt(c, dtype=f32)
    w_up = rng.standard_normal((e, f, c), dtype=f32) / np.sqrt(c, dtype=f32)
    w_down = rng.standard_normal((e, c, f), dtype=f32) / np.sqrt(f, dtype=f32)
    loras = tuple((rng.standard_normal((e, r, i), dtype=f32) * 0.01,
                   rng.standard_normal((e, o, r), dtype=f32) * 0.01, 2.0)
                  for o, i in ((f, c), (f, c), (c, f)))
    dout = rng.standard_normal((t, c), dtype=f32)

    state = {}

    def router():
        sel, w, rcache = router_forward(logits, k, True, 1.0)
        state.update(weights=w, rcache=rcache, dispatch=dispatch_order(sel, e))

    def experts_fwd():
        state["ys"], state["ecache"] = experts_forward_train(
            x, *state["dispatch"], w_gate, w_up, w_down, "silu", loras)

    def comb():
        _, state["ccache"] = combine_forward(state["ys"], state["dispatch"][0], state["weights"])

    def comb_bwd():
        state["dys"], state["dweights"] = combine_backward(dout, state["ccache"])

    def experts_bwd_frozen():
        experts_backward(state["dys"], state["ecache"], (False, False, False))

    def experts_bwd_dw():
        experts_backward(state["dys"], state["ecache"], (True, True, True))

    dw_bufs = (np.empty_like(w_gate), np.empty_like(w_up), np.empty_like(w_down))

    def experts_bwd_dw_reused():
        experts_backward(state["dys"], state["ecache"], (True, True, True), dw_out=dw_bufs)

    def router_bwd():
        router_backward(state["dweights"], state["rcache"])

    s = t * k                                         # token slots, each through one expert
    base = 3 * 2 * s * c * f                          # gate, up, down GEMMs
    lora_fwd = 3 * 2 * s * r * (c + f)                # (x A^T) B^T per projection
    lora_bwd = 2 * lora_fwd                           # dz B, (.) A, dA, dB per projection
    phases = [("router + dispatch", router, 0),
              ("experts forward (LoRA)", experts_fwd, base + lora_fwd),
              ("combine", comb, 2 * t * k * c),
              ("combine backward", comb_bwd, 4 * t * k * c),
              ("experts backward frozen (dx + LoRA)", experts_bwd_frozen, base + lora_bwd),
              ("experts backward + dW, fresh arrays", experts_bwd_dw, 2 * base + lora_bwd),
              ("experts backward + dW into reused dw_out", experts_bwd_dw_reused, 2 * base + lora_bwd),
              ("router backward", router_bwd, 0)]
    for _, fn, _ in phases:                           # fill `state` in order once
        fn()
    rows = [(name, _median_ms(fn, repeat), flops) for name, fn, flops in phases]

    def block(need_dw):
        def fn():
            router()
            experts_fwd()
            comb()
            comb_bwd()
            (experts_bwd_dw_reused if need_dw else experts_bwd_frozen)()
            router_bwd()
        return fn
    fwd_flops = sum(fl for n, _, fl in rows if "backward" not in n) + 4 * t * k * c
    rows.append(("block fwd+bwd, frozen experts (QLoRA)", _median_ms(block(False), repeat),
                 fwd_flops + base + lora_bwd))
    rows.append(("block fwd+bwd, expert dW into dw_out", _median_ms(block(True), repeat),
                 fwd_flops + 2 * base + lora_bwd))
    # the machine's state right now: one dense GEMM with the same shape as all slots' gate GEMM
    xs = rng.standard_normal((s, c), dtype=f32)
    out = np.empty((s, f), f32)
    rows.append((f"reference: dense ({s}x{c}) @ ({c}x{f}) GEMM",
                 _median_ms(lambda: np.matmul(xs, w_gate[0].T, out=out), repeat), 2 * s * c * f))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    a = parser.parse_args(argv)
    rows = run(a.tokens, a.width, a.ffn, a.experts, a.k, a.rank, a.repeat)
    print(f"MoE expert block, float32: T={a.tokens} C={a.width} F={a.ffn} E={a.experts} K={a.k} "
          f"LoRA r={a.rank} on gate/up/down, SwiGLU; median of {a.repeat}; "
          f"numpy {np.__version__}, {os.cpu_count()} CPUs, "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}")
    print(f"{'phase':<46}{'ms':>9}{'GFLOP':>9}{'GFLOP/s':>10}")
    for i, (name, ms, flops) in enumerate(rows):
        if name.startswith("block") and not rows[i - 1][0].startswith("block"):
            print("-" * 74)
        rate = f"{flops / ms / 1e6:10.1f}" if flops >= 1e8 else f"{'-':>10}"
        print(f"{name:<46}{ms:9.2f}{flops / 1e9:9.3f}{rate}")


if __name__ == "__main__":
    main()
