"""`workbench resume RUN_DIR`: continue a paused, killed or finished run of any kind."""

from __future__ import annotations

import dataclasses
import sys

from app.cli.grpo import execute_grpo
from app.cli.preference import METHODS, resume_preference
from app.cli.train import execute_sft
from app.engine.errors import ConfigError
from app.engine.training.events import GRPO_RUN, SFT_RUN


def resume_sft(run_dir, args) -> int:
    from app.engine.training.sft import RunConfig

    config = RunConfig.from_dict(run_dir.config())
    if args.extend_epochs:
        if not config.epochs:
            raise ConfigError("--extend-epochs needs a run that counts epochs.",
                              "Runs with --epochs 0 are extended by editing max_steps.")
        config = dataclasses.replace(config, epochs=config.epochs + args.extend_epochs)
        run_dir.write_config(config.to_dict())
    return execute_sft(run_dir, args.json, args.allow_changed_data)


def resume_grpo(run_dir, args) -> int:
    if args.extend_epochs:
        raise ConfigError("--extend-epochs does not apply to GRPO runs (they count steps).")
    return execute_grpo(run_dir, args.json, args.trust_reward_code, args.allow_changed_data)


RESUME = {SFT_RUN: resume_sft, GRPO_RUN: resume_grpo,   # by run kind (app.engine.runs.kinds)
          **{method: resume_preference for method in METHODS if method != SFT_RUN}}


def cmd_resume(args) -> int:
    from app.engine.runs.kinds import kind_of
    from app.engine.runs.rundir import RunDir

    from app.engine.runs.runlock import RunLock

    run_dir = RunDir(args.run_dir)
    # not a run directory, or an unknown kind: a clear error, nothing touched
    kind = kind_of(run_dir.config(), str(run_dir.config_path))
    with RunLock(run_dir, "workbench resume"):  # another writer: RunBusyError, nothing touched
        if args.step is not None:
            from app.engine.training.checkpoints import rewind

            kept = rewind(run_dir.checkpoints_dir, args.step)
            print(f"resuming from step-{args.step}" + (
                f"; the newer checkpoints are set aside as {', '.join(p.name for p in kept)}"
                if kept else ""), file=sys.stderr)
        return RESUME[kind.name](run_dir, args)
