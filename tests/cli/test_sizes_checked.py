"""Sizes a user can type are checked before anything is allocated (issue 28, probe findings 4,
8 and 12): a LoRA rank, a GRPO group or step of a billion, a run whose memory estimate is past
the machine's, and new-model's layers, experts, context and seed. Each command runs in a
process of its own whose address space is capped, so that a regression fails (a MemoryError
traceback, a timeout) instead of eating the test machine's memory; each exits 2 at once with
the limit named, and leaves no run folder or model behind."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "sample_data"
CAP = 8 << 30      # bytes of address space: numpy and the tiny model need far less


def workbench(args: list[str], cwd: Path, home: Path) -> subprocess.CompletedProcess:
    cap = lambda: resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))  # noqa: E731
    env = {**os.environ, "HOME": str(home)}
    for name in [n for n in env if n.startswith("XDG_")]:
        del env[name]
    proc = subprocess.Popen([sys.executable, "-m", "app", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=cap)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


TRAIN = ["train", "-m", str(SAMPLE / "tiny-moe.gguf"), "-d", str(SAMPLE / "chat.jsonl"),
         "--max-steps", "1"]
GRPO = ["grpo", "-m", str(SAMPLE / "tiny-moe.gguf"), "--prompts", str(SAMPLE / "addition.jsonl"),
        "-r", "exact", "--max-new-tokens", "2", "--max-steps", "1"]
NEW = ["new-model", "--tokenizer", str(SAMPLE / "tiny-moe.gguf"), "--layers", "1",
       "--width", "16", "--heads", "2", "--ffn", "16"]
BILLION = "1000000000"

CASES = {
    "train rank": (TRAIN + ["--rank", BILLION], "train.lora_rank: expected an integer in [1, 4096]"),
    "train expert rank": (TRAIN + ["--expert-rank", BILLION],
                          "train.expert_rank: expected an integer in [1, 4096]"),
    "train batch": (TRAIN + ["--batch", BILLION, "--grad-accum", BILLION],
                    "train.grad_accum: expected an integer in [1, 2147483647]"),
    "train context": (TRAIN + ["--ctx", BILLION], "The context 1,000,000,000 is longer than"),
    "grpo rank": (GRPO + ["--rank", BILLION], "train.lora_rank: expected an integer in [1, 4096]"),
    "grpo group": (GRPO + ["-G", BILLION, "-P", "1"],
                   "group_size: expected an integer in [2, 1024]"),
    "grpo prompts": (GRPO + ["-G", "2", "-P", BILLION],
                     "prompts_per_step: expected an integer in [1, 4096]"),
    # within the ranges, but 1,048,576 completions sampled at once: ~500 GB of KV cache
    "grpo memory": (GRPO[:-4] + ["-G", "1024", "-P", "1024", "--max-new-tokens", "100",
                                 "--max-steps", "1"],
                    "This run needs at least 500.2 GB of memory (sampling 1,048,576 "
                    "completions at once"),
    "new-model layers": (NEW[:3] + ["--layers", "100000000"] + NEW[5:],
                         "100,000,000 layers is more than llama.cpp allows (512)"),
    "new-model experts": (NEW + ["--experts", "100000", "--experts-used", "1"],
                          "100,000 experts is more than llama.cpp allows (512)"),
    "new-model context": (NEW + ["--context", "0"], "A context of 0 tokens is not usable"),
    "new-model seed": (NEW + ["--seed", "-1"], "The seed -1 is not from 0 to 2,147,483,647"),
    "new-model big seed": (NEW + ["--seed", str(2**64)], "is not from 0 to 2,147,483,647"),
}


@pytest.mark.parametrize("case", CASES)
def test_sizes_are_refused_before_allocating(case, tmp_path):
    args, message = CASES[case]
    home = tmp_path / "home"
    home.mkdir()
    out = tmp_path / "out"
    proc = workbench(args + ["-o", str(out)], tmp_path, home)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "hint: " in proc.stderr and "bug" not in proc.stderr
    assert not out.exists()      # no run folder, no model file
