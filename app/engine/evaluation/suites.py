"""Prompt suites: prompts (or chats) the model answers, scored by the GRPO reward functions
(app.engine.training.reward_functions).

A suite is JSONL, one row a line: `"prompt": "text"` or `"messages": [{"role", "content"},
...]` (rendered with the model's chat template and the generation prompt, as GRPO renders its
prompts), the fields its rewards read (`"answer"` for exact and numeric), and optionally
`"reward"`: one reward spec or a list of them in the CLI's grammar (`exact`, `numeric:tol=0.5`,
`regex:PATTERN`, `contains:TEXT`, `format`, `FILE.py`; default `exact`). A Python file is found
beside the suite when its path is relative, and runs only when trusted (the GRPO trust rule: a
suite is a file from elsewhere).

Each row is answered greedily (or `samples` times with temperature 1 and seeds seed, seed+1,
...), every answer scored: its reward is the weighted total, and it passes when that total
reaches the row's `"pass_at"` (default: the sum of the weights, i.e. full marks). The suite's
result is the pass rate over all answers (with sqrt(p (1 - p) / (n - 1)) as its standard
error, as the multiple-choice tasks) and the mean reward.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.engine.data.formats import iter_lines, parse_line
from app.engine.errors import ConfigError, DatasetError
from app.engine.evaluation.results import TaskResult
from app.engine.training.grpo import prompt_ids
from app.engine.training.reward_functions import (RewardScorer, RewardSpec, ScoreItem,
                                                  check_reward_trust, parse_reward)

BATCH = 16                 # prompts decoded together
SAMPLE_TEMPERATURE = 1.0   # with samples > 1


@dataclass
class SuiteRow:
    index: int
    line: int
    row: dict
    specs: tuple[RewardSpec, ...]
    pass_at: float


def _contains(text: str) -> str:
    """`contains:TEXT` is a regex reward on the escaped text (the reward functions' grammar
    has no contains of its own)."""
    return "regex:" + re.escape(text) + ":1"


def _specs(value, line: int, path, folder: Path) -> tuple[RewardSpec, ...]:
    items = ["exact"] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(s, str) for s in items):
        raise DatasetError(f"{path}, line {line}: \"reward\" must be a reward spec or a list "
                           "of them.", "For example \"exact\", \"regex:^Sure\" or [\"exact\", "
                           "\"format\"].")
    out = []
    for text in items:
        if text.startswith("contains:"):
            text = _contains(text[len("contains:"):])
        py = re.match(r"^(file:)?(.+?\.py)(:[^:]*)?$", text)
        if py and not os.path.isabs(py.group(2)):          # beside the suite
            text = f"file:{folder / py.group(2)}{py.group(3) or ''}"
        try:
            spec = parse_reward(text)
        except ConfigError as e:
            raise DatasetError(f"{path}, line {line}: {e.message}", e.hint) from None
        out.append(spec)
    return tuple(out)


def read_suite(path, limit: int | None = None) -> list[SuiteRow]:
    folder = Path(path).resolve().parent
    rows: list[SuiteRow] = []
    for line, raw in iter_lines(path, what="suite"):
        obj = parse_line(line, raw)
        if not isinstance(obj, dict):
            raise DatasetError(f"{path}, line {line}: {getattr(obj, 'message', obj)}.",
                               "A suite row is a JSON object with \"prompt\" or \"messages\".")
        if not isinstance(obj.get("prompt"), (str, list)) and "messages" not in obj:
            raise DatasetError(f"{path}, line {line}: no \"prompt\" or \"messages\".",
                               "A suite row is a JSON object with \"prompt\" or \"messages\".")
        specs = _specs(obj.get("reward"), line, path, folder)
        pass_at = obj.get("pass_at", sum(max(s.weight, 0.0) for s in specs))
        if isinstance(pass_at, bool) or not isinstance(pass_at, (int, float)):
            raise DatasetError(f"{path}, line {line}: \"pass_at\" must be a number.",
                               "The total reward an answer needs to pass.")
        rows.append(SuiteRow(len(rows), line, obj, specs, float(pass_at)))
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise DatasetError(f"{path} has no prompts.", "One JSON object a line, with "
                           "\"prompt\" or \"messages\".")
    return rows


def check_trust(rows: list[SuiteRow], trust: bool = False) -> None:
    """Python rewards run only when trusted (reward_functions' rule)."""
    check_reward_trust([s for r in rows for s in r.specs],
                       "Trust them with --trust-reward-code (or answer Yes in the window).",
                       trust)


def run_suite(model, adapter, scale: float, name: str, rows: list[SuiteRow], *,
              samples: int = 1, seed: int | None = None, max_new_tokens: int = 64,
              progress: Callable[[int, int], None] | None = None):
    if samples < 1:
        raise ConfigError("--samples must be at least 1.")
    tok = model.tokenizer
    prompts = []
    for r in rows:
        try:
            ids, shown = prompt_ids(tok, r.row)
        except ValueError as e:
            raise DatasetError(f"{name}, line {r.line}: {e}.") from None
        prompts.append((ids, shown))
    temperature = 0.0 if samples == 1 else SAMPLE_TEMPERATURE
    base_seed = 0 if seed is None else seed
    jobs = [(i, k) for i in range(len(rows)) for k in range(samples)]
    completions: dict[tuple[int, int], list[int]] = {}
    for a in range(0, len(jobs), BATCH):
        part = jobs[a:a + BATCH]
        outs = model.generate_batch([prompts[i][0] for i, _ in part], max_new_tokens,
                                    temperature, 1.0, [base_seed + k for _, k in part],
                                    adapter, scale, llamacpp_numerics=True)
        completions.update(zip(part, outs))
        if progress is not None:
            progress(min(a + BATCH, len(jobs)), len(jobs))
    stops = set(tok.eot_ids)
    scorers: dict[tuple, RewardScorer] = {}
    records, rewards, passed = [], [], 0
    try:
        for i, k in jobs:
            r, ids = rows[i], completions[(i, k)]
            text = tok.decode(ids[:-1] if ids and ids[-1] in stops else ids, skip_special=True)
            scorer = scorers.get(r.specs)
            if scorer is None:
                scorer = scorers[r.specs] = RewardScorer(r.specs, source=name)
            problem = scorer.check_row(r.row)
            if problem is not None:
                raise DatasetError(f"{name}, line {r.line}: {problem}.")
            values = scorer.score([ScoreItem(prompts[i][1], text, r.row, r.index, r.line,
                                             len(ids), max_new_tokens)])[0]
            total = float(values @ scorer.weights)
            ok = total >= r.pass_at - 1e-9
            passed += ok
            rewards.append(total)
            records.append({"task": name, "index": i, "sample": k, "completion": text,
                            "rewards": values.tolist(), "reward": total, "pass": ok})
    finally:
        for scorer in scorers.values():
            scorer.close()
    n = len(jobs)
    p = passed / n
    stderr = math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")
    return TaskResult(name, "suite", "pass_rate", p, stderr, n,
                      {"passed": passed, "mean_reward": float(np.mean(rewards)),
                       "samples": samples}, records)
