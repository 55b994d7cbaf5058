"""Dataset throughput: tokenizing and windowing a large JSONL chat file with a real tokenizer.

Run from the repository root: ``python -m bench.data [--mb 100] [--model PATH] [--context 1024]``.
Writes a deterministic ``--mb`` MB JSONL file of chat rows (system/user/assistant turns, one to
three exchanges, varied lengths) into a temporary directory, then times, with the Qwen2
tokenizer of tests/data/vocab by default:

* ``tokenize``: `tokenize_file` without the cache: read, parse, render with the model's chat
  template and its assistant spans, tokenize with offsets, build the loss masks;
* ``cache write`` / ``cache load``: the same call storing, then reading, the cache entry;
* ``window``: `Dataset` construction (weights, split, cutting to the context) plus building
  every training Batch of one epoch (shuffle, pack, labels, positions, segments);
* ``lint``: the streaming linter over the whole file.

Each line prints rows/s, MB/s and tokens/s of wall time, and the process CPU time (all threads:
tokenizing runs in parallel Rust threads, overlapped with template rendering in Python), which
stays meaningful when other jobs share the machine. The file generation is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the a little big red blue green happy sad cat dog bird fish tree house park ball "
         "run jump play read sing eat drink sleep walk look find give take make friend mother "
         "father sister brother school garden river hill sun moon star rain snow wind day night "
         "morning evening because then after before when where why how what who yes no maybe "
         "always never often sometimes quickly slowly together alone answer question number "
         "seven twelve forty hundred apple bread milk water cookie story song game picture").split()


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    return " ".join(words).capitalize() + rng.choice(".?!")


def _paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(_sentence(rng, 4, 14) for _ in range(sentences))


def write_chat_jsonl(path: Path, megabytes: float, seed: int = 0) -> int:
    """A chat dataset of about `megabytes` MB; returns the number of rows."""
    rng = random.Random(seed)
    target = int(megabytes * 1e6)
    written = rows = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            messages = [{"role": "system", "content": "You are a kind teacher."}] if rng.random() < 0.3 else []
            for _ in range(rng.randint(1, 3)):
                messages.append({"role": "user", "content": _paragraph(rng, rng.randint(1, 3))})
                messages.append({"role": "assistant", "content": _paragraph(rng, rng.randint(1, 8))})
            line = json.dumps({"messages": messages}) + "\n"
            f.write(line)
            written += len(line.encode())
            rows += 1
    return rows


class _Timer:
    """Wall and process CPU time (all threads) of a block: on a shared machine the CPU time
    shows the cost even when other jobs slow the wall clock."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


def _line(name: str, t: _Timer, rows: int, mb: float, tokens: int) -> None:
    print(f"{name:<12} {t.wall:7.2f} s  {rows / t.wall:9,.0f} rows/s  {mb / t.wall:6.2f} MB/s  "
          f"{tokens / t.wall / 1e6:6.2f} M tokens/s   (CPU {t.cpu:6.2f} s: "
          f"{rows / max(t.cpu, 1e-9):9,.0f} rows per CPU-s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100.0, help="size of the generated JSONL file")
    ap.add_argument("--model", default=str(ROOT / "tests/data/vocab/ggml-vocab-qwen2.gguf"))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--skip-lint", action="store_true")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["WORKBENCH_CACHE_DIR"] = os.path.join(tmp, "cache")
        from app.engine.data.dataset import DataConfig, Dataset, tokenize_file
        from app.engine.data.lint import lint_dataset
        from app.engine.text.tokenizer import load_tokenizer

        path = Path(tmp) / "chat.jsonl"
        rows = write_chat_jsonl(path, args.mb)
        mb = path.stat().st_size / 1e6
        tok = load_tokenizer(args.model)
        config = DataConfig(context=args.context, val_fraction=0.01)
        print(f"{path.name}: {rows:,} rows, {mb:.1f} MB; tokenizer {Path(args.model).name}; "
              f"context {args.context}; {os.cpu_count()} CPUs")

        with _Timer() as t:
            data = tokenize_file(path, tok, config, use_cache=False)
        tokens = len(data.seqs.tokens)
        _line("tokenize", t, rows, mb, tokens)

        with _Timer() as t:
            tokenize_file(path, tok, config, use_cache=True)   # miss: tokenize and write
        _line("cache write", t, rows, mb, tokens)
        with _Timer() as t:
            cached = tokenize_file(path, tok, config, use_cache=True)
        assert cached.from_cache
        _line("cache load", t, rows, mb, tokens)

        with _Timer() as t:
            ds = Dataset(data, config, tok)
            windows = 0
            for step in ds.train_batches(0, grad_accum=4):
                windows += len(step)
        _line("window", t, rows, mb, tokens)
        stats = ds.stats
        print(f"  {windows:,} windows of up to {args.context} positions, fill {stats.fill:.1%}, "
              f"{stats.train_targets / max(stats.train_positions, 1):.1%} of positions trained")

        if not args.skip_lint:
            with _Timer() as t:
                report = lint_dataset(path, tok, config)
            _line("lint", t, rows, mb, report.tokens)


if __name__ == "__main__":
    main()
