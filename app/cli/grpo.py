"""`workbench grpo`: a GRPO-style run (sample, score with rewards, reward-weighted SFT step).

Builds a GrpoConfig from options (or a saved config.json / config.toml), creates the run
directory (config.json with "kind": "grpo") and runs `app.engine.training.grpo.train_grpo` in the
foreground with a progress line (or JSON lines with --json), or adds it to the job queue.
Ctrl-C pauses with a checkpoint; `workbench grpo --resume RUN_DIR` continues exactly.
Custom reward files run as Python with the user's rights: those named with --reward are trusted
by naming them, those a --config or a run directory names need --trust-reward-code once (until
they change; the rule is app.engine.training.reward_functions.check_reward_trust).
"""

from __future__ import annotations

from pathlib import Path

from app.cli.models import model_argument
from app.cli.foreground import (TARGET_ALIASES, TRAINING_DEFAULTS, Progress, add_adapter_options,
                               add_compute_options, add_optimizer_options, add_queue_options,
                               clock, run_in_foreground, show_defaults, start_run)
from app.cli.train import check_adapter_and_format, check_lora_targets
from app.engine.errors import ConfigError
from app.engine.training import events

REWARD_HELP = ("reward function, repeatable, weight after the last colon (default 1): "
               "exact[:tag=T][:W], numeric[:tol=X][:tag=T][:W], regex:PATTERN[:W], "
               "format[:TAG][:W], length[:TARGET][:W], FILE.py[:W] (a Python file defining "
               "reward(prompt, completion, **row) -> float; it runs as Python with your rights: "
               "use only files you wrote or trust)")
TRUST_HELP = ("run the custom reward files a --config or a run directory names: they run as "
              "Python with your rights (files named with --reward are trusted by naming them)")
TRUST_HINT = ("Read the file; if you trust it, run the command again with --trust-reward-code "
              "(it runs as Python with your rights).")


# The options whose help shows their default (read from the config classes when it is printed).
GRPO_DEFAULTS = {
    **TRAINING_DEFAULTS,
    "--group-size": "grpo.group_size", "--prompts-per-step": "grpo.prompts_per_step",
    "--temperature": "grpo.temperature", "--top-p": "grpo.top_p",
    "--max-new-tokens": "grpo.max_new_tokens", "--advantage": "grpo.advantage",
    "--kl": "grpo.kl", "--answer-field": "grpo.answer_field",
    "--reward-timeout": "grpo.reward_timeout", "--val-split": "grpo.val_split",
    "--eval-every": "grpo.eval_every", "--eval-samples": "grpo.eval_samples",
    "--samples-every": "grpo.samples_every", "--lr": "grpo.GRPO_LR",
    "--max-steps": "grpo.max_steps", "--save-every": "grpo.save_every"}


def add_grpo_parser(sub) -> None:
    p = sub.add_parser("grpo", help="GRPO-style training from prompts and reward functions")
    p.add_argument("--model", "-m", help="GGUF model file")
    p.add_argument("--prompts", "-d", help='JSONL of prompts: {"messages": [...]} or '
                                           '{"prompt": "..."}, optional "answer"')
    p.add_argument("--reward", "-r", action="append", metavar="SPEC", help=REWARD_HELP)
    p.add_argument("--config", help="a GRPO run's config.json or a config.toml (options override it)")
    p.add_argument("--out", "-o", help="run directory (default: a new folder under the runs dir)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a paused or interrupted GRPO run")
    add_queue_options(p)
    p.add_argument("--trust-reward-code", action="store_true", help=TRUST_HELP)
    g = p.add_argument_group("sampling and rewards")
    g.add_argument("--group-size", "-G", type=int, help="completions per prompt")
    g.add_argument("--prompts-per-step", "-P", type=int, help="prompts per step")
    g.add_argument("--temperature", "-t", type=float, help="sampling temperature")
    g.add_argument("--top-p", type=float, help="nucleus sampling")
    g.add_argument("--max-new-tokens", "-n", type=int,
                   help="tokens per completion, end-of-turn included")
    g.add_argument("--advantage", choices=("group-std", "no-std", "batch-std"),
                   help="advantage normalisation")
    g.add_argument("--kl", type=float, help="KL penalty coefficient against the base model")
    g.add_argument("--answer-field", help="row field with the reference answer")
    g.add_argument("--reward-timeout", type=float, help="seconds per custom reward call")
    g.add_argument("--val-split", type=float,
                   help="fraction of prompts held out for greedy evaluation")
    g.add_argument("--eval-every", type=int, help="steps between evaluations (0: start and end)")
    g.add_argument("--eval-samples", type=int,
                   help="also sample this many completions per held-out prompt at each evaluation")
    g.add_argument("--samples-every", type=int, help="steps between sampled-completion events")
    g.add_argument("--parse-special", action="store_true",
                   help="plain prompts: special-token texts become their tokens")
    g = p.add_argument_group("training")
    add_adapter_options(g)
    g.add_argument("--dropout", type=float, help="LoRA dropout")
    g.add_argument("--adapter", help="continue training this GGUF LoRA adapter")
    add_optimizer_options(g, ("adamw", "sgd"), "learning rate")
    g.add_argument("--max-steps", type=int, help="optimizer steps")
    g.add_argument("--save-every", type=int, help="steps between checkpoints")
    g.add_argument("--seed", type=int, help="sampling, prompt order, split, initialisation")
    add_compute_options(g)
    show_defaults(p, GRPO_DEFAULTS)


def grpo_config_from_args(args):
    """A GrpoConfig from --config (if any) with the command-line options on top."""
    from app.engine.runtime.schema import check, read_config_file
    from app.engine.training.grpo import GrpoConfig, build_grpo_config
    from app.engine.training.reward_functions import RewardSpec

    base = read_config_file(args.config) if args.config else {}
    base.pop("kind", None)
    check({"model": "", "prompts": "", **base}, GrpoConfig, args.config)
    train = base.setdefault("train", {})
    args.model = model_argument(args.model, args.rank)   # owner/name:QUANT: through the Hub's
    for key, value in (("model", args.model), ("prompts", args.prompts),
                       ("adapter", args.adapter)):
        if value is not None:
            base[key] = value
    options = {"group_size": args.group_size, "prompts_per_step": args.prompts_per_step,
               "temperature": args.temperature, "top_p": args.top_p,
               "max_new_tokens": args.max_new_tokens, "advantage": args.advantage, "kl": args.kl,
               "answer_field": args.answer_field, "reward_timeout": args.reward_timeout,
               "val_split": args.val_split, "eval_every": args.eval_every,
               "eval_samples": args.eval_samples,
               "samples_every": args.samples_every, "max_steps": args.max_steps,
               "save_every": args.save_every}
    base.update({k: v for k, v in options.items() if v is not None})
    if args.parse_special:
        base["parse_special"] = True
    if args.reward:
        base["rewards"] = [RewardSpec.parse(text).to_dict() for text in args.reward]
    targets = lambda s: [TARGET_ALIASES.get(t.strip(), t.strip()) for t in s.split(",") if t]
    train_options = {"lora_rank": args.rank, "expert_rank": args.expert_rank,
                     "lora_alpha": args.alpha,
                     "lora_dropout": args.dropout, "optimizer": args.optimizer, "lr": args.lr,
                     "schedule": args.schedule, "warmup_steps": args.warmup,
                     "warmup_fraction": args.warmup_fraction, "gclip": args.gclip,
                     "max_grad_norm": args.max_grad_norm, "weight_decay": args.weight_decay,
                     "checkpoint_interval": args.checkpoint_interval, "seed": args.seed,
                     "device": args.device, "precision": args.precision,
                     "weight_cache_mb": args.weight_cache_mb,
                     "lora_targets": targets(args.targets) if args.targets else None}
    train.update({k: v for k, v in train_options.items() if v is not None})
    return build_grpo_config(base)


class GrpoProgress(Progress):
    """Progress for GRPO events: a progress line per step with the reward, eval and sample lines."""

    def __call__(self, event: dict) -> None:
        kind = event.get(events.TYPE)
        if kind == events.START and not self.as_json:
            rewards = ", ".join(f"{r['name']} x{r['weight']:g}" for r in event["rewards"])
            return self._line(
                f"start  grpo: {event['total_steps']} steps of {event['prompts_per_step']} prompts "
                f"x {event['group_size']} completions; {event['train_prompts']} training prompts, "
                f"{event['val_prompts']} held out, {event['skipped_rows']} skipped; rewards "
                f"{rewards}; advantage {event['advantage']}, kl {event['kl']:g}; "
                f"{event['trainable']:,} trainable parameters"
                + (f"; resumed at step {event['resumed_at']}" if event["resumed_at"] else ""))
        if self.as_json or kind not in (events.STEP, events.EVAL, events.SAMPLES):
            return super().__call__(event)
        if kind == events.STEP:
            self._step_line(event, grpo_progress_line)
        elif kind == events.EVAL:
            parts = " ".join(f"{n}={v['mean']:.3f}" for n, v in event["rewards"].items())
            text = (f"eval   step {event['step']}: reward={event['reward_mean']:.3f} ({parts}) "
                    f"greedy on {event['prompts']} held-out prompts")
            if event.get("sampled"):
                s = event["sampled"]
                text += (f"; sampled reward={s['reward_mean']:.3f} ({s['samples']} per prompt, "
                         f"T={s['temperature']:g})")
            self._line(text)
        else:
            items = event["items"]
            lines = [f"samples step {event['step']}:"]
            for it in items[:6]:
                lines.append(f"  {it['prompt'][:40]!r} -> {it['completion'][:40]!r} "
                             f"reward={it['reward']:.2f}")
            self._line("\n".join(lines))


def grpo_progress_line(e: dict) -> str:
    cells = 8
    filled = e["step"] / max(e["total_steps"], 1) * cells
    full = int(filled)
    partial = " ▏▎▍▌▋▊▉"[int((filled - full) * 8)] if full < cells else ""
    bar = ("█" * full + partial).ljust(cells)
    per = " ".join(f"{n}={v['mean']:.2f}" for n, v in e["rewards"].items()) \
        if len(e["rewards"]) > 1 else ""
    kl = f" kl={e['kl']:.4f}" if e.get("kl") is not None else ""
    return (f"grpo: [{bar}] step {e['step']:>5}/{e['total_steps']} "
            f"reward={e['reward_mean']:.3f}±{e['reward_std']:.3f} {per}{' ' if per else ''}"
            f"len={e['completion_len_mean']:.1f} clip={100 * e['completion_clipped_fraction']:.0f}% "
            f"flat={100 * e['zero_spread_fraction']:.0f}% loss={e['loss']:+.4f}{kl} "
            f"lr={e['lr']:.2e} {e['step_s']:.2f}s/step t={clock(e['elapsed_s'])} "
            f"ETA={clock(e['eta_s'])}")


def execute_grpo(run_dir, as_json: bool, trust_reward_code: bool = False,
                 allow_changed_inputs: bool = False) -> int:
    """Run a GRPO run directory in this process, recording events in the run directory. Its
    custom reward files must be trusted (`trust_reward_code`: the user trusts them now);
    `allow_changed_inputs`: resume although the model or prompts changed."""
    from app.engine.training.grpo import GrpoConfig, train_grpo
    from app.engine.training.reward_functions import check_reward_trust

    config = GrpoConfig.from_dict(run_dir.config())
    check_reward_trust(config.rewards, TRUST_HINT, trust_reward_code)
    runner = lambda report, should_stop, checkpoints: train_grpo(
        config, report, should_stop, checkpoints, allow_changed_inputs=allow_changed_inputs)
    return run_in_foreground(run_dir, runner, GrpoProgress(as_json))


def cmd_grpo(args) -> int:
    from app.engine.runs.kinds import GRPO, kind_of
    from app.engine.runs.rundir import RunDir
    from app.engine.training.reward_functions import check_reward_trust

    if args.resume:
        run_dir = RunDir(args.resume)
        if kind_of(run_dir.config(), str(run_dir.config_path)) is not GRPO:
            raise ConfigError(f"{run_dir.path} is not a GRPO run.",
                              "Resume training runs with: workbench resume RUN_DIR")
        from app.engine.runs.runlock import RunLock

        with RunLock(run_dir, "workbench grpo --resume"):
            return execute_grpo(run_dir, args.json, args.trust_reward_code)
    from app.engine.runtime.backend import array_module
    from app.engine.runtime.inputs import check_input_file
    from app.engine.training.grpo import check_grpo_memory

    config = grpo_config_from_args(args)
    check_input_file(config.prompts, "prompts file")   # a pipe, a folder: before a run folder
    # --reward replaces the config's rewards: files named on the command line are trusted
    check_reward_trust(config.rewards, TRUST_HINT, args.trust_reward_code or bool(args.reward))
    check_adapter_and_format(config)
    check_lora_targets(config)
    if args.queue is None:   # a queued run may run elsewhere: its machine is not known here
        array_module(config.train.device)  # no usable GPU: say so before a run folder exists
        check_grpo_memory(config)
    return start_run(args, config.to_dict(), f"grpo-{Path(config.prompts).stem}", execute_grpo)
