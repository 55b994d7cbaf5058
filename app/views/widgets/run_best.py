"""The checkpoints a run keeps, and which of them is its best.

A supervised run's best is its lowest validation loss, a GRPO run's its highest held-out
reward, a preference run's (DPO, ORPO, SimPO, KTO) its highest held-out accuracy (then margin:
the engine's choice, marked "best" in its eval events). Playground and Export offer the kept checkpoints with the best one first, as the engine
recorded it (`best_checkpoint`; `checkpoint_choices`); Monitor marks the best evaluation's step
on the curve and Runs shows it, from the eval events (`better`; `BestTracker` reads only the
new events).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from app.engine.api import (GRPO, PREFERENCE_KINDS, EngineError, RunDir, best_checkpoint,
                            read_range)

READ_MAX_BYTES = 16 << 20   # of metrics.jsonl per poll: a long run's history comes in pieces

BEST, FINAL = "best", "final"          # checkpoint choices besides a step number
ACCURACY = "held-out accuracy"         # a preference run's best (Best.metric)


@dataclass(frozen=True)
class Best:
    step: int
    value: float
    metric: str        # "validation" (a loss), "held-out reward" or "held-out accuracy"
    task_acc: float | None = None     # a supervised run's --eval-task accuracy at that step

    def text(self) -> str:
        task = "" if self.task_acc is None else f", task accuracy {self.task_acc:.2f}"
        return f"step {self.step} ({self.metric} {self.value:.2f}{task})"


def better(event: dict, kind: str, best: Best | None) -> Best | None:
    """The run's best after the eval `event` (`best` before it); None when there is none."""
    if kind == GRPO.name:
        value = event.get("reward_mean")
        if isinstance(value, (int, float)) and (best is None or value > best.value):
            return Best(int(event.get("step", 0)), float(value), "held-out reward")
    elif kind in PREFERENCE_KINDS:
        value = event.get(PREFERENCE_KINDS[kind].metric)
        if event.get("best") and isinstance(value, (int, float)):
            return Best(int(event.get("step", 0)), float(value), ACCURACY)
    elif event.get("best") and isinstance(event.get("loss"), (int, float)):
        task = event.get("task_acc")            # --eval-task (its --best-by may choose)
        return Best(int(event.get("step", 0)), float(event["loss"]), "validation",
                    float(task) if isinstance(task, (int, float)) else None)
    return best


def run_best(run_dir: str) -> Best | None:
    """The run's best kept checkpoint (None: no evaluation made one, or unreadable)."""
    try:
        found = best_checkpoint(run_dir)
        kind = RunDir(run_dir).config().get("kind") if found is not None else None
    except EngineError:
        return None
    if found is None:
        return None
    step, _, value = found
    return Best(step, value, "held-out reward" if kind == GRPO.name else
                ACCURACY if kind in PREFERENCE_KINDS else "validation")


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
    checkpoint ("best", when it is kept), the final adapter ("final"), every other kept step.
    Each checkpoint is listed once, labelled with all it is: a finished run's final adapter
    holds the weights of its last step, so a kept checkpoint of that step is not listed again."""
    steps = kept_checkpoints(run_dir)
    best = run_best(run_dir)
    best_step = best.step if best is not None and best.step in steps else None
    final_step = _final_step(run_dir)
    out = []
    if best_step is not None:
        also = ", also the final adapter" if best_step == final_step else ""
        out.append((BEST, f"Best checkpoint, {best.text()}{also}"))
    if Path(run_dir, "adapter.gguf").is_file() and (best_step is None or best_step != final_step):
        at = f", step {final_step}" if final_step in steps else ""
        out.append((FINAL, f"Final adapter (adapter.gguf){at}"))
    out += [(str(step), f"Checkpoint at step {step}")
            for step in steps if step not in (best_step, final_step)]
    return out


def _final_step(run_dir: str) -> int | None:
    """The step of a finished run's final adapter (None: not finished, or no adapter.gguf)."""
    try:
        status = RunDir(run_dir).status()
    except EngineError:
        return None
    step = status.get("step")
    done = status.get("state") == "done" and Path(run_dir, "adapter.gguf").is_file()
    return step if done and isinstance(step, int) else None


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
    """Each run's best so far and the time of its first event. Only the lines appended since
    the last call are read, and only eval events are parsed: a long run's metrics.jsonl holds
    megabytes of steps, and parsing them in the reader thread would hold up the GUI thread."""

    def __init__(self):
        self._seen: dict[str, tuple[int, Best | None, float | None]] = {}

    def best(self, run: RunDir, kind: str) -> tuple[Best | None, float | None]:
        """(the best evaluation, the first event's time) of `run`."""
        key = str(run.path)
        offset, best, started = self._seen.get(key, (0, None, None))
        try:
            data = read_range(run.metrics_path, "run's metrics", offset, READ_MAX_BYTES)
        except (OSError, EngineError):                # missing, or not a regular file
            return best, started
        end = data.rfind(b"\n") + 1                    # complete lines only
        if end == 0 and len(data) == READ_MAX_BYTES:   # one line longer than a read: skipped
            end = len(data)
        lines = data[:end].splitlines()
        if started is None and lines:
            started = _number(lines[0], "time")
        for line in lines:
            event = _event(line) if b'"eval"' in line else {}
            if event.get("type") == "eval":
                best = better(event, kind, best)
        self._seen[key] = (offset + end, best, started)
        return best, started


def _event(line: bytes) -> dict:
    try:
        event = json.loads(line)
    except ValueError:
        return {}
    return event if isinstance(event, dict) else {}


def _number(line: bytes, key: str) -> float | None:
    value = _event(line).get(key)
    return float(value) if isinstance(value, (int, float)) else None
