"""Run kinds: what a run directory's config.json "kind" means, in one table.

Each kind names its config class (the schema of its config.json), the loop the worker runs for
it, and what the window and `workbench runs` show of it: its labels and its headline metric
(the status.json key a row shows, and whether lower or higher is better). A config without
"kind" is a supervised run ("sft"), as every run was before GRPO. Code that needs to know a
run's kind asks this table, not the string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from app.engine.errors import ConfigError
from app.engine.evaluation import during_training, job as eval_job
from app.engine.runs.runlock import RunLock
from app.engine.training import grpo, preference, sft


@dataclass(frozen=True)
class RunKind:
    name: str
    config_class: type
    run_job: Callable          # (RunDir, JobControl) -> final state, as the worker calls it
    label: str                 # short: a Runs column
    title: str                 # long: New run's choice
    metric: str                # the headline metric: its status.json key
    lower_is_better: bool      # for the headline metric


def _run_sft_job(run_dir, control) -> str:
    """A supervised run, with its eval_task scored at every evaluation (evaluation layer)."""
    return sft.run_sft_job(run_dir, control, during_training.task_evaluator)


SFT = RunKind(sft.KIND, sft.RunConfig, _run_sft_job, label="SFT", title="Supervised (SFT)",
              metric="loss", lower_is_better=True)
GRPO = RunKind(grpo.KIND, grpo.GrpoConfig, grpo.run_grpo_job, label="GRPO",
               title="GRPO (reward-driven)", metric="reward_mean", lower_is_better=False)
KINDS = {k.name: k for k in (SFT, GRPO)}    # the run types New run offers
# Preference runs (app.engine.training.preference): one config class, the method is the kind.
# Their headline is the held-out preference accuracy (the best checkpoint's too). New run
# offers them after KINDS (its Run type), as `workbench train --method` does.
PREFERENCE_KINDS = {m: RunKind(m, preference.PreferenceConfig, preference.run_preference_job,
                               label=m.upper() if m != "simpo" else "SimPO",
                               title=preference.METHOD_TITLES[m], metric=preference.HEADLINE,
                               lower_is_better=False)
                    for m in preference.METHODS}


def _run_eval_job(run_dir, control) -> str:
    """An evaluation (app.engine.evaluation.job), saved into its run under the run's lock."""
    return eval_job.run_eval_job(run_dir, control,
                                 lambda path: RunLock(path, "an evaluation").acquire())


# An evaluation queued from the Evaluate screen or `workbench eval --queue`: its folder is
# RUN_DIR/evals/<id>/ (not a run of the runs list); its results go to RUN_DIR/evals.jsonl.
EVAL = RunKind(eval_job.KIND, eval_job.EvalConfig, _run_eval_job, label="Eval",
               title="Evaluation", metric="step", lower_is_better=False)
RUN_KINDS = {**KINDS, **PREFERENCE_KINDS, EVAL.name: EVAL}   # every kind a run directory may name


def kind_of(config: dict, where: str = "config.json") -> RunKind:
    """The kind a run config names (none: "sft"); an unknown kind is a ConfigError."""
    name = config.get("kind", sft.KIND)
    if not isinstance(name, str) or name not in RUN_KINDS:    # a list is unhashable
        raise ConfigError(f"Unknown run kind {name!r} in {where}.",
                          f"Use one of {', '.join(RUN_KINDS)} (no kind: {sft.KIND}).")
    return RUN_KINDS[name]


def run_job(run_dir, control) -> str:
    """The worker's runner: the loop of the run directory's kind."""
    return kind_of(run_dir.config(), str(run_dir.config_path)).run_job(run_dir, control)
