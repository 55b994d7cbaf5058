"""One model, its base and any adapters, over a list of tasks: what `workbench eval --task` and
the Evaluate screen run.

A task spec names a format and a file: `hellaswag:FILE`, `winogrande:FILE`, `mc:FILE` (llama.cpp's
binary multiple choice), `FILE.jsonl` or `jsonl:FILE` (multiple choice in JSONL),
`suite:FILE` (a prompt suite scored by reward functions, app.engine.evaluation.suites) and
`ppl:FILE` (perplexity of a text, as `workbench eval -f`). Each (model or adapter, task) gives a
`TaskResult`: the headline metric with its standard error and one record per task item.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from app.engine.errors import Cancelled, ConfigError
from app.engine.evaluation import KINDS, SPEC_HELP, scoring, suites, tasks
from app.engine.evaluation.results import TaskResult, table  # noqa: F401  (table: the CLI's)
from app.engine.evaluation.perplexity import perplexity

@dataclass(frozen=True)
class TaskSpec:
    kind: str
    path: str

    @property
    def name(self) -> str:
        """The column's name: the kind and the file's name (`hellaswag:val.txt`)."""
        return f"{self.kind}:{Path(self.path).name}"

    def to_text(self) -> str:
        return f"{self.kind}:{self.path}"


def parse_task(text: str) -> TaskSpec:
    kind, sep, path = text.partition(":")
    if sep and kind in KINDS and path:
        return TaskSpec(kind, path)
    if text.endswith(".jsonl"):
        return TaskSpec("jsonl", text)
    raise ConfigError(f"Not a task: {text!r}.", f"Name a task as {SPEC_HELP}.")


@dataclass
class Target:
    """What is evaluated: the base model (adapter None) or the base with an adapter."""
    label: str
    adapter: object = None
    scale: float = 1.0


def run_choice_task(model, params, spec: TaskSpec, items: Sequence[tasks.ChoiceTask],
                    progress: Callable[[int, int], None] | None) -> TaskResult:
    scores = scoring.score_tasks(model, params, spec.kind, items, progress)
    records, right, right_raw = [], 0, 0
    for i, (item, s) in enumerate(zip(items, scores)):
        raw_choice = max(range(len(s.raw)), key=lambda k: (s.raw[k], -k))
        right += s.choice in item.correct
        right_raw += raw_choice in item.correct
        records.append({"task": spec.name, "index": i, "choice": s.choice, "gold": item.gold,
                        "scores": s.scores, "raw": s.raw})
    acc = scoring.Accuracy(len(items), right)
    return TaskResult(spec.name, spec.kind, "acc", acc.acc, acc.stderr, len(items),
                      {"correct": right, "acc_raw": right_raw / len(items)}, records)


def run_perplexity(model, target: Target, spec: TaskSpec, n_ctx: int,
                   progress: Callable[[int, int], None] | None) -> TaskResult:
    r = perplexity(model, spec.path, n_ctx, target.adapter, target.scale, progress)
    return TaskResult(spec.name, "ppl", "ppl", r.ppl, None, r.n_scored,
                      {"nll": r.nll, "n_chunks": r.n_chunks, "n_ctx": r.n_ctx})


@dataclass
class Loaded:
    """A task's items, read once for every target."""
    spec: TaskSpec
    items: list = field(default_factory=list)


def load_tasks(specs: Sequence[TaskSpec], limit: int | None = None) -> list[Loaded]:
    """Read every task file before anything runs: a bad file fails at once, with its line."""
    out = []
    for spec in specs:
        if not os.path.exists(spec.path):
            raise ConfigError(f"No task file {spec.path}.", "Check the path of --task.")
        if spec.kind == "suite":
            out.append(Loaded(spec, suites.read_suite(spec.path, limit)))
        elif spec.kind == "ppl":
            out.append(Loaded(spec))
        else:
            out.append(Loaded(spec, tasks.read_tasks(spec.kind, spec.path, limit)))
    return out


Progress = Callable[[str, str, int, int], None]    # (target label, task name, done, total)


def evaluate(model, targets: Sequence[Target], loaded: Sequence[Loaded], *, n_ctx: int = 512,
             samples: int = 1, seed: int | None = None, max_new_tokens: int = 64,
             progress: Progress | None = None,
             should_stop: Callable[[], object] | None = None) -> dict[str, list[TaskResult]]:
    """{target label: one TaskResult per task}, every target over every task with one loaded
    model. should_stop (any true value) raises Cancelled between task packs."""
    out: dict[str, list[TaskResult]] = {}
    for target in targets:
        params = model.params(target.adapter, target.scale, llamacpp_numerics=True)
        rows = []
        for task in loaded:
            def step(done: int, total: int, _t=target, _s=task.spec) -> None:
                if should_stop is not None and should_stop():
                    raise Cancelled("The evaluation was cancelled.")
                if progress is not None:
                    progress(_t.label, _s.name, done, total)

            step(0, 1)
            if task.spec.kind == "ppl":
                rows.append(run_perplexity(model, target, task.spec, n_ctx, step))
            elif task.spec.kind == "suite":
                rows.append(suites.run_suite(model, target.adapter, target.scale, task.spec.name,
                                             task.items, samples=samples, seed=seed,
                                             max_new_tokens=max_new_tokens, progress=step))
            else:
                rows.append(run_choice_task(model, params, task.spec, task.items, step))
        out[target.label] = rows
    return out
