"""llama.cpp's llama-finetune as a peer: full fine-tuning of an F32 model on the CPU, when the
binary is on PATH (it is not on the dev machines, so this path is untested there).

Runs ``llama-finetune -m MODEL -f TEXT -c C -b C -ub C -t THREADS -ngl 0 --epochs 1 -o OUT``
on random printable bytes (a byte vocabulary makes that about one token per byte), sized for
about `steps` + 1 sequences: ggml-opt cuts the text into windows of C tokens at a stride of
C/2 and keeps 5% for validation. Its progress line on stderr reads
``train: [bar] data=0000012/0000019 loss=5.54321±0.1 acc=... t=00:00:05 ETA=00:00:00``; the last
one gives tokens/s = data x C / t. t has a resolution of one second, so the figure is coarse
for short runs; it includes the first (warm-up) step. Peak RSS: the child's ru_maxrss.
"""

from __future__ import annotations

import re
import resource
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

PROGRESS = re.compile(r"train: \[[^\]]*\] data=(\d+)/(\d+) loss=([\d.]+).*? "
                      r"t=(\d+):(\d+):(\d+)")


def parse_progress(stderr: str) -> dict | None:
    """The last training progress line: {"data", "data_max", "loss", "seconds"}, or None."""
    matches = PROGRESS.findall(stderr)
    if not matches:
        return None
    data, data_max, loss, h, m, s = matches[-1]
    return {"data": int(data), "data_max": int(data_max), "loss": float(loss),
            "seconds": int(h) * 3600 + int(m) * 60 + int(s)}


def run_finetune(w, n_threads: int) -> dict:
    """Time llama-finetune on the workload's model: figures, or {"skipped": why}."""
    binary = shutil.which("llama-finetune")
    if binary is None:
        return {"skipped": "llama-finetune not installed"}
    if w.mode != "full":
        return {"skipped": "llama-finetune fine-tunes the full model only"}
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "train.txt"
        n_bytes = (w.steps + 3) * w.ctx // 2 * 21 // 20 + w.ctx
        rng = np.random.default_rng(0)
        text.write_bytes(rng.integers(32, 127, n_bytes, dtype=np.uint8).tobytes())
        cmd = [binary, "-m", w.model, "-f", str(text), "-c", str(w.ctx), "-b", str(w.ctx),
               "-ub", str(w.ctx), "-t", str(n_threads), "-ngl", "0", "--epochs", "1",
               "-o", str(Path(tmp) / "out.gguf")]
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    progress = parse_progress(proc.stderr)
    if proc.returncode or progress is None or not progress["seconds"]:
        tail = proc.stderr.strip().splitlines()[-3:]
        return {"error": f"llama-finetune exit {proc.returncode}: " + " | ".join(tail)}
    tokens = progress["data"] * w.ctx
    return {"tokens_per_s": tokens / progress["seconds"],
            "step_ms": progress["seconds"] * 1e3 / progress["data"], "loss_last": progress["loss"],
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
            "command": " ".join(cmd)}
