"""A multiple-choice task scored at every evaluation of a supervised run (`--eval-task SPEC`,
RunConfig.eval_task): its accuracy goes into each eval event (`task`, `task_acc`), a metric
curve beside the validation loss.

The task is read once, before training (a bad file fails the run before its first step), and
its first `eval_task_limit` items are scored with the session's evaluation parameters (the
adapter as trained so far, float32 as training computes, no dropout), choices picked as
llama-perplexity picks them (app.engine.evaluation.scoring).
"""

from __future__ import annotations

from collections.abc import Callable

from app.engine.errors import ConfigError
from app.engine.evaluation import runner, scoring, tasks

CHOICE_KINDS = ("hellaswag", "winogrande", "mc", "jsonl")


def task_evaluator(config) -> Callable | None:
    """`on_eval(session) -> {"task", "task_acc"}` for a RunConfig with an eval_task, else None."""
    if not getattr(config, "eval_task", ""):
        return None
    spec = runner.parse_task(config.eval_task)
    if spec.kind not in CHOICE_KINDS:
        raise ConfigError(f"--eval-task takes a multiple-choice task, not {spec.kind}.",
                          "Use hellaswag:FILE, winogrande:FILE, mc:FILE or FILE.jsonl.")
    items = tasks.read_tasks(spec.kind, spec.path, config.eval_task_limit)

    def on_eval(session) -> dict:
        scores = scoring.score_tasks(session.model, session.eval_params, spec.kind, items)
        right = sum(s.choice in t.correct for s, t in zip(scores, items))
        return {"task": spec.name, "task_acc": right / len(items)}

    return on_eval
