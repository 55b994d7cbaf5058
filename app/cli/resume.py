"""`workbench resume RUN_DIR`: continue a paused, killed or finished run of any kind."""

from __future__ import annotations

import dataclasses
import sys

from app.cli.grpo import execute_grpo
from app.cli.train import execute_sft
from app.engine.errors import ConfigError


def cmd_resume(args) -> int:
    from app.engine.runs.rundir import RunDir
    from app.engine.training.sft import RunConfig

    run_dir = RunDir(args.run_dir)
    kind = run_dir.config().get("kind")  # not a run directory: a clear error, nothing touched
    if args.step is not None:
        from app.engine.training.checkpoints import rewind

        kept = rewind(run_dir.checkpoints_dir, args.step)
        print(f"resuming from step-{args.step}" + (
            f"; the newer checkpoints are set aside as {', '.join(p.name for p in kept)}"
            if kept else ""), file=sys.stderr)
    if kind == "grpo":
        if args.extend_epochs:
            raise ConfigError("--extend-epochs does not apply to GRPO runs (they count steps).")
        return execute_grpo(run_dir, args.json, args.trust_reward_code)
    config = RunConfig.from_dict(run_dir.config())
    if args.extend_epochs:
        if not config.epochs:
            raise ConfigError("--extend-epochs needs a run that counts epochs.",
                              "Runs with --epochs 0 are extended by editing max_steps.")
        config = dataclasses.replace(config, epochs=config.epochs + args.extend_epochs)
        run_dir.write_config(config.to_dict())
    return execute_sft(run_dir, args.json)
