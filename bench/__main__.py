"""``python -m bench``: the training-speed table (bench/table.py);
``python -m bench train ...``: one configuration as one JSON object (bench/train.py);
``python -m bench moe-shapes ...``: the real-size MoE rows (bench/moe_shapes.py, issue 20);
``python -m bench bf16-gemm``: the bf16 product libraries side by side (bench/bf16_gemm.py,
issue 30).

The micro-benchmarks run on their own: ``python -m bench.forward``, ``bench.dequant``,
``bench.moe_kernels``, ``bench.optim``, ``bench.data``.
"""

from __future__ import annotations

import sys


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:
        from bench.train import main as train
        train(argv[1:])
    elif argv[:1] == ["bf16-gemm"]:
        from bench.bf16_gemm import main as bf16_gemm
        bf16_gemm(argv[1:])
    elif argv[:1] == ["moe-shapes"]:
        from bench.moe_shapes import main as moe_shapes
        moe_shapes(argv[1:])
    else:
        from bench.table import main as table
        table(argv)


if __name__ == "__main__":
    main()
