"""`workbench train` and `workbench resume`: a run in the foreground (or queued), with progress.

Builds a RunConfig from options (or a saved config.json / config.toml), creates the run
directory, and runs `app.engine.run.train` with a reporter that appends every event to
metrics.jsonl and prints a progress line as ggml-opt does (or JSON lines with --json).
Ctrl-C pauses: the run saves a checkpoint and `workbench resume RUN_DIR` continues it exactly.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from pathlib import Path

from app.engine.errors import ConfigError

TARGET_ALIASES = {"attn": "attention"}


def add_train_parsers(sub) -> None:
    p = sub.add_parser("train", help="train a LoRA adapter or fine-tune a model on a dataset")
    p.add_argument("--model", "-m", help="GGUF model file")
    p.add_argument("--data", "-d", help="JSONL dataset")
    p.add_argument("--config", help="a run's config.json or a config.toml (options override it)")
    p.add_argument("--out", "-o", help="run directory (default: a new folder under the runs dir)")
    p.add_argument("--queue", nargs="?", const="", default=None, metavar="QUEUE",
                   help="add the run to the job queue instead of running it here")
    p.add_argument("--json", action="store_true", help="print events as JSON lines")
    g = p.add_argument_group("what to train")
    g.add_argument("--mode", choices=("lora", "full", "hybrid"))
    g.add_argument("--rank", type=int)
    g.add_argument("--alpha", type=float)
    g.add_argument("--targets", help="comma list: attn, ffn, experts, shared, router, output")
    g.add_argument("--full-targets", help="hybrid runs: norms, router, embeddings, output")
    g.add_argument("--dropout", type=float, help="LoRA dropout")
    g.add_argument("--adapter", help="continue training this GGUF LoRA adapter")
    g = p.add_argument_group("optimisation")
    g.add_argument("--optimizer", choices=("adamw", "sgd", "lbfgs"))
    g.add_argument("--lr", type=float)
    g.add_argument("--schedule", choices=("constant", "linear", "cosine"))
    g.add_argument("--warmup", type=int, help="warmup steps")
    g.add_argument("--epochs", type=int)
    g.add_argument("--max-steps", type=int, help="cap on optimizer steps (--epochs 0: exactly)")
    g.add_argument("--batch", type=int, help="windows per optimizer step (accumulated)")
    g.add_argument("--grad-accum", type=int)
    g.add_argument("--gclip", type=float, help="element-wise gradient clip (0: off)")
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--checkpoint-interval", type=int, help="gradient checkpointing every N layers")
    g.add_argument("--seed", type=int)
    add_compute_options(g)
    g = p.add_argument_group("data")
    g.add_argument("--ctx", type=int, help="context (tokens per window)")
    g.add_argument("--format", help="auto, text, completion, chat, alpaca, sharegpt")
    g.add_argument("--val-split", type=float, help="validation fraction")
    g.add_argument("--val-data", help="a separate validation file")
    g.add_argument("--weights", help="reward-weights file")
    g.add_argument("--normalize", choices=("none", "mean-std", "min-max", "clip"))
    g.add_argument("--allow-negative", action="store_true", help="allow negative weights")
    g.add_argument("--strict", action="store_true", help="refuse to start on any bad row")
    g.add_argument("--overflow", choices=("truncate", "split", "drop"), help="rows longer than ctx")
    g.add_argument("--packing", choices=("pack", "pad", "none"))
    g.add_argument("--chat-loss", choices=("assistant", "last"), help="which assistant turns train")
    g.add_argument("--completion-as-chat", action="store_true",
                   help="render prompt/completion rows with the chat template")
    g.add_argument("--parse-special", action="store_true",
                   help="special-token texts in text/completion rows become their tokens")
    g = p.add_argument_group("run")
    g.add_argument("--eval-every", type=int)
    g.add_argument("--save-every", type=int)
    g.add_argument("--patience", type=int, help="early stopping (evaluations without gain)")

    p = sub.add_parser("resume", help="continue an interrupted or finished run")
    p.add_argument("run_dir")
    p.add_argument("--extend-epochs", type=int, default=0, help="train this many more epochs")
    p.add_argument("--step", type=int, help="resume from this checkpoint step (the newer ones "
                                            "are set aside as step-N.skipped)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--trust-reward-code", action="store_true",
                   help="GRPO runs: run the custom reward files the run names (they run as "
                        "Python with your rights)")


def add_compute_options(group) -> None:
    """--device and --weight-cache-mb (TrainConfig.device, .weight_cache_mb): train and grpo."""
    group.add_argument("--device", choices=("cpu", "cuda"),
                       help="where the step computes: cpu (NumPy, default) or cuda (CuPy)")
    group.add_argument("--weight-cache-mb", type=int, help="dequantized weights kept in memory "
                       "(default 40%% of RAM; 0: dequantize at every use, least memory)")


def run_config_from_args(args):
    """A RunConfig from --config (if any) with the command-line options on top. Every problem
    of the file is reported at once, before the options go on top of it."""
    from app.engine.config_schema import check, read_config_file
    from app.engine.run import RunConfig

    base = read_config_file(args.config) if args.config else {}
    check({"model": "", "data": "", **base}, RunConfig, args.config)
    base.setdefault("train", {})
    base.setdefault("data_config", {})
    train, data = base["train"], base["data_config"]
    for key, value in (("model", args.model), ("data", args.data), ("epochs", args.epochs),
                       ("max_steps", args.max_steps),
                       ("eval_every", args.eval_every), ("save_every", args.save_every),
                       ("patience", args.patience), ("adapter", args.adapter)):
        if value is not None:
            base[key] = str(Path(value).resolve()) if key in ("model", "data", "adapter") else value
    targets = lambda s: [TARGET_ALIASES.get(t.strip(), t.strip()) for t in s.split(",") if t]
    options = {"mode": args.mode, "lora_rank": args.rank, "lora_alpha": args.alpha,
               "lora_dropout": args.dropout, "optimizer": args.optimizer, "lr": args.lr,
               "schedule": args.schedule, "warmup_steps": args.warmup, "gclip": args.gclip,
               "weight_decay": args.weight_decay, "checkpoint_interval": args.checkpoint_interval,
               "seed": args.seed, "device": args.device,
               "weight_cache_mb": args.weight_cache_mb,
               "lora_targets": targets(args.targets) if args.targets else None,
               "full_targets": targets(args.full_targets) if args.full_targets else None}
    if args.batch or args.grad_accum:
        options["grad_accum"] = (args.batch or 1) * (args.grad_accum or 1)
    train.update({k: v for k, v in options.items() if v is not None})
    data_options = {"context": args.ctx, "format": args.format, "val_fraction": args.val_split,
                    "val_path": args.val_data, "weights_path": args.weights,
                    "normalize": args.normalize, "seed": args.seed, "overflow": args.overflow,
                    "packing": args.packing, "chat_loss": args.chat_loss}
    data.update({k: v for k, v in data_options.items() if v is not None})
    if args.allow_negative:
        data["allow_negative_weights"] = True
    for flag in ("strict", "completion_as_chat", "parse_special"):
        if getattr(args, flag):
            data[flag] = True
    if "model" not in base or "data" not in base:
        raise ConfigError("A run needs a model and a dataset.", "Pass --model and --data.")
    config = RunConfig.from_dict(base)
    config.validate()
    return config


class Progress:
    """Prints events: a progress line per step (like ggml-opt's), or JSON lines."""

    def __init__(self, as_json: bool, stream=None):
        self.as_json, self.stream = as_json, stream or sys.stdout
        self.tty = self.stream.isatty()
        self.last_print = 0.0

    def __call__(self, event: dict) -> None:
        if self.as_json:
            self.stream.write(json.dumps(event, default=float) + "\n")
            self.stream.flush()
            return
        kind = event.get("type")
        if kind == "step":
            now = time.monotonic()
            final = event["step"] == event["total_steps"]
            if self.tty or final or now - self.last_print > 5.0:
                end = "\r" if self.tty and not final else "\n"
                self.stream.write(_progress_line(event) + end)
                self.stream.flush()
                self.last_print = now
        elif kind == "eval":
            self._line(f"eval   step {event['step']}: loss={event['loss']:.5f} "
                       f"acc={100 * event['accuracy']:.2f}% ppl={event['perplexity']:.2f}"
                       + ("  (best)" if event.get("best") else ""))
        elif kind in ("log", "start", "done"):
            text = event.get("message") or " ".join(
                f"{k}={v}" for k, v in event.items() if k not in ("type", "time"))
            self._line(f"{kind:<6} {text}")

    def _line(self, text: str) -> None:
        prefix = "\n" if self.tty else ""
        self.stream.write(prefix + text + "\n")
        self.stream.flush()


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _progress_line(e: dict) -> str:
    cells = 8
    filled = e["step"] / max(e["total_steps"], 1) * cells
    full = int(filled)
    partial = " ▏▎▍▌▋▊▉"[int((filled - full) * 8)] if full < cells else ""
    bar = ("█" * full + partial).ljust(cells)
    return (f"train: [{bar}] epoch {e['epoch']}/{e['epochs']} step {e['step']:>5}/"
            f"{e['total_steps']} loss={e['epoch_loss']:.5f}±{e['epoch_loss_se']:.5f} "
            f"acc={100 * e['epoch_accuracy']:.2f}±{100 * e['epoch_accuracy_se']:.2f}% "
            f"lr={e['lr']:.2e} {e['tokens_per_s']:.0f} tok/s t={_clock(e['elapsed_s'])} "
            f"ETA={_clock(e['eta_s'])}")


def run_in_foreground(run_dir, runner, printer, status_keys=("loss",)) -> int:
    """Run `runner(report, should_stop, checkpoints)` (a train or train_grpo closure) here,
    recording every event in the run directory; Ctrl-C (or SIGTERM) pauses after the step."""
    from app.engine.errors import EngineError
    from app.engine.worker import install_stop_signals, restore_signals

    stop = threading.Event()

    def report(event: dict) -> None:
        stored = run_dir.append_metrics(event)
        if event.get("type") == "step":
            run_dir.write_status(state="running", step=event["step"],
                                 total_steps=event["total_steps"], epoch=event["epoch"],
                                 eta_s=event["eta_s"], fsync=False,
                                 **{k: event[k] for k in status_keys})
        printer(stored)

    run_dir.write_status(state="running")
    previous = install_stop_signals(stop)
    try:
        result = runner(report, lambda: "pause" if stop.is_set() else None,
                        run_dir.checkpoints_dir)
    except KeyboardInterrupt:  # a second Ctrl-C: stop now, the last checkpoint stays usable
        run_dir.write_status(state="paused")
        return 130
    except BaseException as e:
        info = e.to_dict() if isinstance(e, EngineError) else {"kind": "bug", "message": str(e)}
        run_dir.write_status(state="failed", error=info)
        raise
    finally:
        restore_signals(previous)
    run_dir.write_status(state=result)
    if result == "paused":
        print(f"paused: continue with  workbench resume {run_dir.path}", file=sys.stderr)
        return 130
    print(f"run finished: {run_dir.path}", file=sys.stderr)
    return 0


def _execute(run_dir, as_json: bool) -> int:
    """Run a training run directory's config in this process."""
    from app.engine.run import RunConfig, train

    config = RunConfig.from_dict(run_dir.config())
    runner = lambda report, should_stop, checkpoints: train(config, report, should_stop,
                                                             checkpoints)
    return run_in_foreground(run_dir, runner, Progress(as_json))


def cmd_train(args) -> int:
    from app.engine.backend import array_module

    config = run_config_from_args(args)
    if args.queue is None:
        array_module(config.train.device)  # no usable GPU: say so before a run folder exists
    return start_run(args, config.to_dict(), Path(config.data).stem, _execute)


def start_run(args, config: dict, name: str, execute) -> int:
    """Create the run directory (--out, or a dated folder under the runs dir) and either add it
    to the job queue (--queue) or run it here with `execute(run_dir, as_json)`."""
    from app.engine.rundir import RunDir, check_path_length, default_run_name, default_runs_dir

    out = Path(args.out) if args.out else Path(default_runs_dir()) / default_run_name(name)
    check_path_length(out)
    existed = out.exists()
    run_dir = RunDir.create(out, config)
    if args.queue is not None:
        from app.engine.jobs import JobQueue

        try:
            job_id = JobQueue(args.queue or None).add(run_dir.path)
        except BaseException:  # the queue refused it: the same command must work next time
            _take_back(run_dir, existed)
            raise
        print(f"queued job {job_id}: {run_dir.path}")
        return 0
    print(f"run directory: {run_dir.path}", file=sys.stderr)
    return execute(run_dir, args.json)


def _take_back(run_dir, existed: bool) -> None:
    """Undo `RunDir.create`: the folder, or (a folder given with --out that was there before)
    what create put in it."""
    import shutil

    if not existed:
        shutil.rmtree(run_dir.path, ignore_errors=True)
        return
    run_dir.config_path.unlink(missing_ok=True)
    for folder in (run_dir.checkpoints_dir, run_dir.exports_dir):
        try:
            folder.rmdir()  # only if empty
        except OSError:
            pass


def cmd_resume(args) -> int:
    from app.engine.rundir import RunDir
    from app.engine.run import RunConfig

    run_dir = RunDir(args.run_dir)
    kind = run_dir.config().get("kind")  # not a run directory: a clear error, nothing touched
    if args.step is not None:
        from app.engine.checkpoint import rewind

        kept = rewind(run_dir.checkpoints_dir, args.step)
        print(f"resuming from step-{args.step}" + (
            f"; the newer checkpoints are set aside as {', '.join(p.name for p in kept)}"
            if kept else ""), file=sys.stderr)
    if kind == "grpo":
        from app.cli_grpo import execute_grpo

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
    return _execute(run_dir, args.json)
