"""The checkpoints a run keeps, and which of them is its best.

A supervised run's best is its last evaluation marked `"best": true` (the lowest validation
loss so far); a GRPO run's, the evaluation with the highest held-out reward. Playground and
Export offer the kept checkpoints with the best one first (`checkpoint_choices`), Monitor marks
its step on the curve and Runs shows it (`BestTracker`, which reads only the new events).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from app.engine.api import GRPO, EngineError, RunDir

BEST, FINAL = "best", "final"          # checkpoint choices besides a step number


@dataclass(frozen=True)
class Best:
    step: int
    value: float
    metric: str                        # "validation" (a loss) or "held-out reward"

    def text(self) -> str:
        return f"step {self.step} ({self.metric} {self.value:.2f})"


def better(event: dict, kind: str, best: Best | None) -> Best | None:
    """The run's best after the eval `event` (`best` before it); None when there is none."""
    if kind == GRPO.name:
        value = event.get("reward_mean")
        if isinstance(value, (int, float)) and (best is None or value > best.value):
            return Best(int(event.get("step", 0)), float(value), "held-out reward")
    elif event.get("best") and isinstance(event.get("loss"), (int, float)):
        return Best(int(event.get("step", 0)), float(event["loss"]), "validation")
    return best


def best_of(events: list[dict], kind: str) -> Best | None:
    best = None
    for event in events:
        if event.get("type") == "eval":
            best = better(event, kind, best)
    return best


def run_best(run_dir: str) -> Best | None:
    """The best evaluation of the run at `run_dir` (None: no evaluation, or unreadable)."""
    try:
        run = RunDir(run_dir)
        return best_of(run.metrics(), str(run.config().get("kind", "sft")))
    except EngineError:
        return None


def kept_checkpoints(run_dir: str) -> list[int]:
    """Steps of the run's checkpoints, newest first."""
    steps = []
    for p in Path(run_dir, "checkpoints").glob("step-*"):
        m = re.fullmatch(r"step-(\d+)", p.name)
        if m and p.is_dir():
            steps.append(int(m.group(1)))
    return sorted(steps, reverse=True)


def checkpoint_choices(run_dir: str) -> list[tuple[str, str]]:
    """(data, label) of what a user can take from the run, the default first: the best
    checkpoint ("best", when it is kept), the final adapter ("final"), every kept step."""
    steps = kept_checkpoints(run_dir)
    best = run_best(run_dir)
    out = []
    if best is not None and best.step in steps:
        out.append((BEST, f"Best checkpoint, {best.text()}"))
    if Path(run_dir, "adapter.gguf").is_file():
        out.append((FINAL, "Final adapter (adapter.gguf)"))
    for step in steps:
        mark = " (the best)" if best is not None and step == best.step else ""
        out.append((str(step), f"Checkpoint at step {step}{mark}"))
    return out


def choice_step(run_dir: str, choice: str) -> int | None:
    """The checkpoint step a choice stands for (None: the final adapter)."""
    if choice == FINAL:
        return None
    if choice == BEST:
        best = run_best(run_dir)
        if best is None:
            raise EngineError("The run has no best checkpoint yet.",
                              "Pick a kept checkpoint or the final adapter.")
        return best.step
    return int(choice)


class BestTracker:
    """Each run's best so far and the time of its first event, reading only the events
    appended since the last call."""

    def __init__(self):
        self._seen: dict[str, tuple[int, Best | None, float | None]] = {}

    def best(self, run: RunDir, kind: str) -> tuple[Best | None, float | None]:
        """(the best evaluation, the first event's time) of `run`."""
        key = str(run.path)
        offset, best, started = self._seen.get(key, (0, None, None))
        try:
            events, offset = run.read_metrics(offset)
        except EngineError:
            return best, started
        for event in events:
            if started is None and isinstance(event.get("time"), (int, float)):
                started = float(event["time"])
            if event.get("type") == "eval":
                best = better(event, kind, best)
        self._seen[key] = (offset, best, started)
        return best, started
