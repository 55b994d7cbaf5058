"""`workbench train`: a supervised run in the foreground (or queued), with progress.

Builds a RunConfig from options (or a saved config.json / config.toml), creates the run
directory, and runs `app.engine.training.sft.train` with a reporter that appends every event to
metrics.jsonl and prints a progress line as ggml-opt does (or JSON lines with --json).
Ctrl-C pauses: the run saves a checkpoint and `workbench resume RUN_DIR` (app.cli.resume)
continues it exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

from app.cli.models import model_argument
from app.cli.foreground import (TARGET_ALIASES, TRAINING_DEFAULTS, Progress, add_adapter_options,
                               add_compute_options, add_optimizer_options, add_queue_options,
                               run_in_foreground, show_defaults, start_run)
from app.cli.preference import add_preference_options, cmd_train_preference, run_method
from app.engine.errors import ConfigError

# The options whose help shows their default (read from the config classes when it is printed).
TRAIN_DEFAULTS = {
    **TRAINING_DEFAULTS, "--mode": "train.mode",
    "--epochs": "run.epochs", "--max-steps": "run.max_steps", "--grad-accum": "train.grad_accum",
    "--format": "data.format", "--val-split": "data.val_fraction",
    "--normalize": "data.normalize", "--overflow": "data.overflow", "--packing": "data.packing",
    "--chat-loss": "data.chat_loss", "--eval-every": "run.eval_every",
    "--save-every": "run.save_every", "--patience": "run.patience", "--workers": "run.workers"}
LR_HELP = ("learning rate (default: 0.005 x sqrt(16 / alpha) for LoRA, whatever the rank; "
           "0.0001 for full fine-tuning)")


def add_train_parsers(sub) -> None:
    p = sub.add_parser("train", help="train a LoRA adapter or fine-tune a model on a dataset")
    p.add_argument("--model", "-m", help="GGUF model file")
    p.add_argument("--data", "-d", help="JSONL dataset")
    p.add_argument("--config", help="a run's config.json or a config.toml (options override it)")
    p.add_argument("--out", "-o", help="run directory (default: a new folder under the runs dir)")
    add_queue_options(p)
    g = p.add_argument_group("what to train")
    g.add_argument("--mode", choices=("lora", "full", "hybrid"), help="what trains")
    add_adapter_options(g)
    g.add_argument("--full-targets", help="hybrid runs: norms, router, embeddings, output")
    g.add_argument("--dropout", type=float, help="LoRA dropout")
    g.add_argument("--adapter", help="continue training this GGUF LoRA adapter")
    g = p.add_argument_group("optimisation")
    add_optimizer_options(g, ("adamw", "sgd", "lbfgs"), LR_HELP)
    g.add_argument("--epochs", type=int, help="passes over the data")
    g.add_argument("--max-steps", type=int, help="cap on optimizer steps (--epochs 0: exactly)")
    g.add_argument("--batch", type=int, help="windows per optimizer step (accumulated)")
    g.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    g.add_argument("--seed", type=int, help="data order, split and initialisation")
    add_compute_options(g)
    g = p.add_argument_group("data")
    g.add_argument("--ctx", type=int, help="context (tokens per window), at most the model's; "
                                           "default: the smaller of 512 and the model's")
    g.add_argument("--format", help="auto, text, completion, chat, alpaca, sharegpt")
    g.add_argument("--val-split", type=float, help="validation fraction")
    g.add_argument("--val-data", help="a separate validation file")
    g.add_argument("--weights", help="reward-weights file")
    g.add_argument("--normalize", choices=("none", "mean-std", "min-max", "clip"),
                   help="reward-weight normalisation")
    g.add_argument("--allow-negative", action="store_true", help="allow negative weights")
    g.add_argument("--strict", action="store_true", help="refuse to start on any bad row")
    g.add_argument("--overflow", choices=("truncate", "split", "drop"), help="rows longer than ctx")
    g.add_argument("--packing", choices=("pack", "pad", "none"), help="short rows per window")
    g.add_argument("--chat-loss", choices=("assistant", "last"), help="which assistant turns train")
    g.add_argument("--completion-as-chat", action="store_true",
                   help="render prompt/completion rows with the chat template")
    g.add_argument("--parse-special", action="store_true",
                   help="special-token texts in text/completion rows become their tokens")
    g.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template to use instead of the model's (kept in the run's "
                        "config.json)")
    g = p.add_argument_group("run")
    g.add_argument("--eval-every", type=int,
                   help="steps between validations (0: each epoch's end)")
    g.add_argument("--save-every", type=int,
                   help="steps between checkpoints (0: each epoch's end)")
    g.add_argument("--patience", type=int, help="early stopping (evaluations without gain)")
    g.add_argument("--eval-task", metavar="SPEC",
                   help="a multiple-choice task (hellaswag:FILE, winogrande:FILE, mc:FILE, "
                        "FILE.jsonl) scored at every evaluation: its accuracy is a curve of the run")
    g.add_argument("--eval-task-limit", type=int, help="the task's first N items (default 50)")
    g.add_argument("--best-by", choices=["loss", "task"],
                   help="the best checkpoint: the lowest validation loss (default) or the "
                        "highest --eval-task accuracy")
    g.add_argument("--workers", type=int, help="data-parallel workers: a run sent to a Ray "
                                               "cluster (--on) trains as N ranks")
    add_preference_options(p)
    show_defaults(p, TRAIN_DEFAULTS)

    p = sub.add_parser("resume", help="continue an interrupted or finished run")
    p.add_argument("run_dir")
    p.add_argument("--extend-epochs", type=int, default=0, help="train this many more epochs")
    p.add_argument("--step", type=int, help="resume from this checkpoint step (the newer ones "
                                            "are set aside as step-N.skipped)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--trust-reward-code", action="store_true",
                   help="GRPO runs: run the custom reward files the run names (they run as "
                        "Python with your rights)")
    p.add_argument("--allow-changed-data", action="store_true",
                   help="continue although the model or data changed since the checkpoint "
                        "(refused otherwise, naming the file)")


def train_options(args) -> dict:
    """The TrainConfig settings the command line gives (those not given are left out): train's
    and a preference run's."""
    targets = lambda s: [TARGET_ALIASES.get(t.strip(), t.strip()) for t in s.split(",") if t]
    options = {"mode": args.mode, "lora_rank": args.rank, "expert_rank": args.expert_rank,
               "lora_alpha": args.alpha,
               "lora_dropout": args.dropout, "optimizer": args.optimizer, "lr": args.lr,
               "schedule": args.schedule, "warmup_steps": args.warmup,
               "warmup_fraction": args.warmup_fraction, "gclip": args.gclip,
               "max_grad_norm": args.max_grad_norm,
               "weight_decay": args.weight_decay, "checkpoint_interval": args.checkpoint_interval,
               "seed": args.seed, "device": args.device, "precision": args.precision,
               "weight_cache_mb": args.weight_cache_mb,
               "lora_targets": targets(args.targets) if args.targets else None,
               "full_targets": targets(args.full_targets) if args.full_targets else None}
    if args.batch or args.grad_accum:
        options["grad_accum"] = (args.batch or 1) * (args.grad_accum or 1)
    return {k: v for k, v in options.items() if v is not None}


def run_config_from_args(args):
    """A RunConfig from --config (if any) with the command-line options on top. Every problem
    of the file is reported at once, before the options go on top of it."""
    from app.engine.model.card import describe_model
    from app.engine.runtime.schema import check, read_config_file
    from app.engine.training.config import TrainConfig, check_context, default_context, default_lr
    from app.engine.training.sft import RunConfig

    base = read_config_file(args.config) if args.config else {}
    check({"model": "", "data": "", **base}, RunConfig, args.config)
    args.model = model_argument(args.model, args.rank, args.ctx)   # owner/name:QUANT: the Hub's
    base.setdefault("train", {})
    base.setdefault("data_config", {})
    train, data = base["train"], base["data_config"]
    for key, value in (("model", args.model), ("data", args.data), ("epochs", args.epochs),
                       ("max_steps", args.max_steps),
                       ("eval_every", args.eval_every), ("save_every", args.save_every),
                       ("patience", args.patience), ("adapter", args.adapter),
                       ("workers", args.workers), ("eval_task_limit", args.eval_task_limit),
                       ("best_by", args.best_by)):
        if value is not None:
            base[key] = str(Path(value).resolve()) if key in ("model", "data", "adapter") else value
    train.update(train_options(args))
    data_options = {"context": args.ctx, "format": args.format, "val_fraction": args.val_split,
                    "val_path": args.val_data, "weights_path": args.weights,
                    "normalize": args.normalize, "seed": args.seed, "overflow": args.overflow,
                    "packing": args.packing, "chat_loss": args.chat_loss}
    data.update({k: v for k, v in data_options.items() if v is not None})
    if args.eval_task:         # its file's absolute path: the run may be resumed from elsewhere
        from app.engine.evaluation.runner import parse_task
        task = parse_task(args.eval_task)
        base["eval_task"] = f"{task.kind}:{Path(task.path).resolve()}"
    if args.allow_negative:
        data["allow_negative_weights"] = True
    for flag in ("strict", "completion_as_chat", "parse_special"):
        if getattr(args, flag):
            data[flag] = True
    if args.chat_template is not None:
        from app.engine.text.chat_template import read_chat_template

        data["chat_template"] = read_chat_template(args.chat_template)
    if "model" not in base or "data" not in base:
        raise ConfigError("A run needs a model and a dataset.", "Pass --model and --data.")
    if "lr" not in train:
        train["lr"] = default_lr(train.get("mode", TrainConfig.mode),
                                 train.get("lora_alpha", TrainConfig.lora_alpha))
    card = describe_model(base["model"])
    data.setdefault("context", default_context(card))
    config = RunConfig.from_dict(base)
    config.validate()
    check_context(config.data_config.context, card)
    return config


def check_lora_targets(config) -> None:
    """The LoRA targets must make an adapter llama.cpp can load (app.engine.model.lora
    .check_model_targets): refused before a run folder exists; warnings printed."""
    if config.train.mode == "full" or config.adapter:
        return
    from app.engine.model.lora import check_model_targets

    for warning in check_model_targets(config.model, config.train.lora_targets):
        print(f"warning: {warning}", file=sys.stderr)


def check_adapter_and_format(config, data_config=None) -> None:
    """The cheap checks of what would otherwise fail while the run prepares, done before a run
    folder exists (and before a run is queued, where the worker would fail it): `--adapter` is
    a GGUF LoRA adapter (its header), and the dataset's format can be told (its first rows;
    `data_config`: a training run's, given for a queued run). What needs the whole dataset
    tokenized (rows all rejected or too long: "Nothing to train on") is found when the run
    starts: a foreground run that fails before its first step removes its folder
    (foreground.start_run)."""
    if config.adapter:
        from app.engine.model.lora import read_adapter_header

        read_adapter_header(config.adapter)
    if data_config is not None:
        from app.engine.data.dataset import resolve_format

        resolve_format(config.data, data_config)


def execute_sft(run_dir, as_json: bool, allow_changed_inputs: bool = False) -> int:
    """Run a training run directory's config in this process (`allow_changed_inputs`: resume
    although the model or data changed since the checkpoint)."""
    from app.engine.training.sft import RunConfig, train

    from app.engine.evaluation.during_training import task_evaluator

    config = RunConfig.from_dict(run_dir.config())
    on_eval = task_evaluator(config)           # the task file read before the first step
    runner = lambda report, should_stop, checkpoints: train(
        config, report, should_stop, checkpoints, allow_changed_inputs=allow_changed_inputs,
        on_eval=on_eval)
    return run_in_foreground(run_dir, runner, Progress(as_json))


def cmd_train(args) -> int:
    from app.engine.data.dataset import check_data_files
    from app.engine.runtime.backend import array_module
    from app.engine.training.memory import check_run_memory

    method = run_method(args)
    if method != "sft":
        return cmd_train_preference(args, method, train_options(args))
    config = run_config_from_args(args)
    if config.workers > 1 and not args.on:   # only a cluster's job runs data-parallel
        raise ConfigError(f"--workers {config.workers} trains data-parallel on a Ray cluster; "
                          "this machine trains a run in one process.",
                          "Send the run to a cluster with --on CLUSTER (see `workbench cluster "
                          "list`), or leave --workers out.")
    check_data_files(config.data, config.data_config)   # a pipe, a folder: before a run folder
    # the format up front only for a queued run: reading the first rows of a dataset whose
    # first line is 64 GB takes minutes, which a run in the foreground spends showing progress
    check_adapter_and_format(config, config.data_config if args.queue is not None else None)
    check_lora_targets(config)
    if args.queue is None:   # a queued run may run elsewhere: its machine is not known here
        array_module(config.train.device)  # no usable GPU: say so before a run folder exists
        check_run_memory(config.model, config.train, config.data_config.context)
    return start_run(args, config.to_dict(), Path(config.data).stem, execute_sft)
