"""Verifying an export: read back what was written and compare it with what was meant.

Every export ends with a report (`ExportReport`): a list of checks, each with `ok` (True, False,
or None when skipped, inconclusive or informational) and its numbers. The export is good when no
check failed. The checks here are the building blocks (`app.engine.export.exporter` runs them per format):

- stored tensors against the intended float values, within the stored type's rounding;
- the engine's logits on a fixed prompt with the re-read export against the live adapter (or
  fully trained tensors): exact up to float32 noise when everything is stored as F32; otherwise
  against the same rounded values computed in memory, with the drift from the live result
  reported for information (F16/BF16/Q8_0 rounding moves logits and can flip MoE routing);
- merged models: the mean NLL on a held-out sample within 1% of base + adapter (`nll_check`);
- the same file in llama.cpp (`llama-cpp-python`, extra `verify`) when installed, run in a
  child process so that a crash of the native library cannot take the workbench down; when it
  cannot run, the report says so.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from app.engine.errors import EngineError
from app.engine.model.context import ForwardContext
from app.engine.runs.destinations import make_parent
from app.engine.runtime.files import atomic_write_json

# Worst |stored - intended| of a stored type relative to the tensor's largest |value| (F16/BF16:
# half an ulp; Q8_0: half a step of amax/127 plus the fp16 scale; Q4/Q5: up to one step where
# the extreme value clamps). Types without an entry only have to be finite and within 1x.
TYPE_REL_ERROR = {0: 1e-6, 1: 1e-3, 30: 8e-3, 8: 1e-2, 2: 1 / 6, 3: 1 / 6, 6: 1 / 12, 7: 1 / 12}
TYPE_NAMES = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1"}

# Logit tolerance when the export should compute exactly what it is compared with: float32
# noise (merging B @ A into W reorders sums) and, for gemma3, fp16 GELU-table bucket flips.
LOGIT_FLOOR = 2e-3
LOGIT_REL = 1e-4

VERIFY_TEXT = "The quick brown fox jumps over the lazy dog. 0123456789"
MAX_PROMPT = 32

# A held-out sample (no training data) on which a merged model must keep the adapter's effect:
# its mean NLL within NLL_REL_BOUND of base + adapter's.
HELD_OUT_TEXT = (
    "The lighthouse keeper climbed the spiral stairs each evening before sunset. From the "
    "gallery she could see the fishing boats returning, the harbour wall, and the long road "
    "that wound between the hills toward the market town. In winter the storms came from the "
    "west, and the lamp had to burn through the night; in summer the work was lighter, and she "
    "spent the afternoons repairing nets, writing letters, and reading old almanacs about tides, "
    "weather and the stars. Question: what did she do in summer? Answer: she repaired nets.")
NLL_REL_BOUND = 0.01
MAX_HELD_OUT = 160


@dataclass
class Check:
    name: str
    ok: bool | None            # None: skipped or inconclusive (never makes an export fail)
    detail: str = ""
    data: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "ok": self.ok, "detail": self.detail, **self.data}


@dataclass
class ExportReport:
    """The verification report of one export (stored as JSON next to it)."""

    format: str
    path: str
    files: list[str] = field(default_factory=list)
    source: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    prompt_tokens: list[int] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    created_at: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc)
                            .isoformat(timespec="seconds"))
    report_paths: list[str] = field(default_factory=list)
    moved_from: str = ""       # failed verification: where it was asked for (`path` is aside)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok is not False for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.ok is False]

    @property
    def max_abs_logit_diff(self) -> float | None:
        diffs = [c.data["max_abs_diff"] for c in self.checks
                 if c.name.endswith(("logits", "drift")) and "max_abs_diff" in c.data]
        return max(diffs) if diffs else None

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        return check

    def to_dict(self) -> dict:
        return {"ok": self.ok, "format": self.format, "path": self.path, "files": self.files,
                "created_at": self.created_at, "source": self.source, "settings": self.settings,
                "prompt_tokens": self.prompt_tokens,
                "max_abs_logit_diff": self.max_abs_logit_diff,
                "checks": [c.to_dict() for c in self.checks], "warnings": self.warnings,
                "moved_from": self.moved_from or None}

    def to_text(self) -> str:
        lines = [f"{'OK' if self.ok else 'FAILED'}  {self.format} export: {self.path}"]
        if self.moved_from:
            lines.append(f"  moved aside: it failed verification, so it was not left at "
                         f"{self.moved_from}")
        for c in self.checks:
            mark = {True: "ok  ", False: "FAIL", None: "info" if c.data.get("informational")
                    else "skip"}[c.ok]
            lines.append(f"  {mark}  {c.name:<16} {c.detail}")
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        for p in self.report_paths:
            lines.append(f"  report: {p}")
        return "\n".join(lines)

    def write(self, paths: Sequence[str | os.PathLike]) -> None:
        self.report_paths = [str(p) for p in paths]
        for p in paths:
            make_parent(Path(p))
            atomic_write_json(p, self.to_dict())


def _num(x) -> float:
    return float(x) if np.isfinite(x) else float("inf")


# ---- prompt and logits -------------------------------------------------------------------------

def verification_prompt(model, text: str = VERIFY_TEXT, limit: int = MAX_PROMPT) -> list[int]:
    """A fixed prompt in the model's tokens (at most `limit`), for comparing logits."""
    try:
        ids = model.tokenizer.encode(text)
    except (EngineError, ValueError):  # a vocab the tokenizer cannot build: fixed ids will do
        ids = []
    if len(ids) < 4:
        ids = [i % model.config.n_vocab for i in range(7, 7 + 16 * 13, 13)]
    return [int(i) for i in ids[:limit]]


def engine_logits(model, tokens, adapter=None, scale: float = 1.0, full: dict | None = None):
    """The engine's logits (T, V) with an adapter and fully trained tensors in place of the base,
    in plain float32 (trained tensors are float32: no llama.cpp activation rounding)."""
    if not full:
        return model.logits(tokens, adapter=adapter, adapter_scale=scale, llamacpp_numerics=False)
    tokens = model.check_tokens(tokens)
    params = model.params(adapter, scale, full=full)
    x = model.hidden(tokens, params, ForwardContext.build(model.config, tokens.size, None))
    return model.head_logits(x, params)


def logit_tolerance(want: np.ndarray, effect: float = 0.0) -> float:
    """Tolerance for logits that should match `want` up to float32 noise; `effect` is the size
    of the trained change on the logits (max |live - base|)."""
    return LOGIT_FLOOR + LOGIT_REL * (float(np.abs(want).max()) + effect)


def logits_check(name: str, got: np.ndarray, want: np.ndarray, tolerance: float,
                 reference: str, statistic: str = "max") -> Check:
    """Compare logits (T, V): the max |difference| (statistic "max"), or the median over
    positions of each position's max (statistic "median": robust to the isolated positions
    where a rounding flips an MoE expert choice), against the tolerance."""
    if got.shape == want.shape:
        per_position = np.abs(got.astype(np.float64) - want).reshape(len(got), -1).max(axis=1)
        diff, median = _num(per_position.max()), _num(np.median(per_position))
    else:
        diff = median = float("inf")
    value = median if statistic == "median" else diff
    ok = value <= tolerance
    what = (f"median per-position max |logit diff| {median:.3g} (max {diff:.3g})"
            if statistic == "median" else f"max |logit diff| {diff:.3g}")
    return Check(name, ok, f"{what} vs {reference} (tolerance {tolerance:.3g})",
                 {"max_abs_diff": diff, "median_position_max_diff": median,
                  "statistic": statistic, "tolerance": tolerance, "reference": reference})


def add_logit_checks(report: ExportReport, prefix: str, got: np.ndarray, live: np.ndarray,
                     base: np.ndarray | None, reference: str, intent: np.ndarray | None = None,
                     rounding: str = "") -> None:
    """The logits checks of an export: `got` (engine, re-read export) against `live` (engine,
    live adapter/tensors) when the export stores everything in F32; otherwise against `intent`
    (the same rounded values computed in memory), with the drift from `live` reported for
    information (rounding to F16/BF16/Q8_0 shifts logits, and can flip MoE routing)."""
    effect = float(np.abs(live - base).max()) if base is not None else 0.0
    if intent is None:
        report.add(logits_check(prefix + "logits", got, live, logit_tolerance(live, effect),
                                reference))
        return
    report.add(logits_check(prefix + "logits", got, intent, logit_tolerance(intent),
                            f"the same {rounding} values computed in memory"))
    drift = logits_check(prefix + "drift", got, live, float("inf"), reference)
    drift.ok = None
    drift.detail = (f"max |logit diff| {drift.data['max_abs_diff']:.3g} vs {reference}, from "
                    f"rounding to {rounding} (informational)")
    drift.data.update(tolerance=None, informational=True)
    report.add(drift)


def nll_check(name: str, merged: float, live: float, base: float, fix: str) -> Check:
    """The merged model's mean NLL on the held-out sample against base + adapter's: within
    NLL_REL_BOUND (relative), else a failure that names the option that fixes it."""
    rel = abs(merged - live) / max(abs(live), 1e-12)
    ok = bool(rel <= NLL_REL_BOUND)
    detail = (f"mean NLL on a held-out sample: merged {merged:.4f}, base + adapter {live:.4f} "
              f"({rel:.2%} apart, bound {NLL_REL_BOUND:.0%}; perplexity {math.exp(merged):.3f} vs "
              f"{math.exp(live):.3f}), base alone {base:.4f}")
    if not ok:
        detail += f". The merge loses part of the adapter's effect: {fix}"
    return Check(name, ok, detail, {"merged_nll": merged, "live_nll": live, "base_nll": base,
                                    "relative_diff": rel, "bound": NLL_REL_BOUND})


# ---- tensors -----------------------------------------------------------------------------------

class TensorComparison:
    """Accumulates |stored - intended| per tensor against the stored type's bound."""

    def __init__(self, name: str = "tensors"):
        self.name = name
        self.n = 0
        self.worst: tuple[float, str] = (0.0, "")
        self.bad: list[str] = []

    def add(self, label: str, got: np.ndarray, want: np.ndarray, ggml_type: int) -> None:
        self.n += 1
        want = np.asarray(want, np.float32)
        got = np.asarray(got, np.float32)
        if got.shape != want.shape:
            self.bad.append(f"{label}: shape {got.shape}, expected {want.shape}")
            return
        if got.size == 0:
            return
        err = _num(np.abs(got - want).max()) if np.isfinite(got).all() else float("inf")
        bound = TYPE_REL_ERROR.get(ggml_type, 1.0) * float(np.abs(want).max()) + 1e-7
        rel = err / max(float(np.abs(want).max()), 1e-30)
        if rel > self.worst[0] or not self.worst[1]:
            self.worst = (rel, label)
        if not err <= bound:
            self.bad.append(f"{label}: max error {err:.3g} > {bound:.3g} "
                            f"({TYPE_NAMES.get(ggml_type, ggml_type)})")

    def check(self) -> Check:
        data = {"n_compared": self.n, "worst_relative_error": self.worst[0],
                "worst_tensor": self.worst[1], "problems": self.bad[:20]}
        if self.bad:
            return Check(self.name, False, f"{len(self.bad)} of {self.n} stored arrays differ from "
                         f"what was meant: {self.bad[0]}", data)
        return Check(self.name, True, f"{self.n} stored arrays as intended (worst relative error "
                     f"{self.worst[0]:.2g} in {self.worst[1] or '-'})", data)


# ---- llama.cpp (optional) ----------------------------------------------------------------------

_LLAMACPP_SCRIPT = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
a = json.loads(sys.argv[1])
n = len(a["tokens"])
kw = dict(model_path=a["model"], logits_all=True, n_ctx=max(32, n), n_batch=max(32, n),
          n_ubatch=max(32, n), n_threads=1, n_threads_batch=1, n_gpu_layers=0, type_k=0,
          type_v=0, flash_attn=False, seed=0, verbose=False, use_mmap=not a.get("lora"))
if a.get("lora"):
    kw.update(lora_path=a["lora"], lora_scale=a["scale"])
llm = Llama(**kw)
llm.eval(a["tokens"])
np.save(a["out"], np.asarray(llm.scores[:n], dtype=np.float32))
"""


def llamacpp_python() -> str | None:
    """The interpreter that has llama-cpp-python: $WORKBENCH_LLAMACPP_PYTHON, else this one if
    it can import llama_cpp, else None."""
    env = os.environ.get("WORKBENCH_LLAMACPP_PYTHON")
    if env:
        return env
    try:
        found = importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        found = False
    return sys.executable if found else None


def llamacpp_tolerance(weight_types) -> tuple[str, float]:
    """(statistic, tolerance) for llama.cpp vs the engine. Every weight (base and adapter) F32:
    max 2e-3 (they agree to ~1e-5, gemma3 ~3e-4). Otherwise llama.cpp rounds activations to
    F16/BF16 (for F16/BF16 weights) or Q8_0 (quantized ones, SPEC 6), which moves logits by
    ~1e-2 and ~1e-1 and can flip an expert choice at some positions: the median over positions
    must stay within 0.1 or 0.5. A misread file (names, shapes, alpha) misses by whole logits."""
    types = set(weight_types)
    if types <= {0}:
        return "max", 2e-3
    return ("median", 0.1) if types <= {0, 1, 30} else ("median", 0.5)


def llamacpp_check(model_path: str, tokens: Sequence[int], ours: np.ndarray, *,
                   lora_path: str | None = None, weight_types=(0,),
                   enabled: bool | None = None, timeout: float = 900.0,
                   name: str = "llamacpp") -> Check:
    """Load the export in llama.cpp (child process) and compare its logits with ours
    (tolerance from llamacpp_tolerance). A crash (this build segfaults on some files) or an
    unloadable library is inconclusive (ok None), not a failure."""
    if enabled is False:
        return Check(name, None, "skipped (disabled)", {"skipped": "disabled"})
    python = llamacpp_python()
    if python is None:
        return Check(name, None, "skipped: llama-cpp-python is not installed "
                     "(pip install 'gguf-workbench[verify]')", {"skipped": "not installed"})
    with tempfile.TemporaryDirectory(prefix="workbench-llamacpp-") as tmp:
        out = os.path.join(tmp, "logits.npy")
        args = {"model": str(model_path), "tokens": [int(t) for t in tokens], "out": out,
                "lora": str(lora_path) if lora_path else None, "scale": 1.0}
        try:
            proc = subprocess.run([python, "-c", _LLAMACPP_SCRIPT, json.dumps(args)],
                                  capture_output=True, text=True, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            return Check(name, None, f"inconclusive: llama.cpp did not run ({e})",
                         {"skipped": str(e)})
        if proc.returncode != 0 or not os.path.exists(out):
            lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
            why = f"signal {-proc.returncode}" if proc.returncode < 0 else lines[-1]
            return Check(name, None, f"inconclusive: llama.cpp failed ({why})",
                         {"skipped": why, "returncode": proc.returncode})
        theirs = np.load(out)
    statistic, tolerance = llamacpp_tolerance(weight_types)
    check = logits_check(name, ours, theirs, tolerance, "llama.cpp", statistic)
    check.data["interpreter"] = python
    return check
