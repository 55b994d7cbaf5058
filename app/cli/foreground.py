"""Runs in this process, as `workbench train` and `workbench grpo` start them: the run folder
(or a queued job), the progress printer, Ctrl-C as a pause, the shared compute options."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import threading
import time
from pathlib import Path

from app.engine.errors import EngineError
from app.engine.training import events

TARGET_ALIASES = {"attn": "attention"}


CONFIG_CLASSES = {"train": ("app.engine.training.config", "TrainConfig"),
                  "data": ("app.engine.data.dataset", "DataConfig"),
                  "run": ("app.engine.training.sft", "RunConfig"),
                  "grpo": ("app.engine.training.grpo", "GrpoConfig")}


def show_defaults(parser, fields: dict[str, str]) -> None:
    """Make `parser`'s help end each option of `fields` ("--lr": "train.lr") with its default
    from the config class (CONFIG_CLASSES: the one source of the defaults), read only when
    the help is printed, so that building the parser loads no engine module."""
    parser.formatter_class = ConfigDefaultsHelp
    for action in parser._actions:
        for option in action.option_strings:
            if option in fields:
                action.config_field = fields[option]


class ConfigDefaultsHelp(argparse.HelpFormatter):
    def _get_help_string(self, action):
        field = getattr(action, "config_field", None)
        if field is None:
            return action.help
        return f"{action.help or ''} {default_of(field)}".strip()


def default_of(field: str) -> str:
    """"(default: V)" for a config field ("train.lr": CONFIG_CLASSES) or a constant of the
    config class's module ("grpo.GRPO_LR")."""
    kind, name = field.split(".")
    module_name, cls = CONFIG_CLASSES[kind]
    module = importlib.import_module(module_name)
    fields = getattr(module, cls).__dataclass_fields__
    value = fields[name].default if name in fields else getattr(module, name)
    if isinstance(value, tuple):
        value = ",".join(value) or "none"
    elif isinstance(value, float):
        value = f"{value:g}"
    return f"(default: {value})".replace("%", "%%")


# TrainConfig's options that train and grpo share: their help shows these defaults.
TRAINING_DEFAULTS = {
    "--rank": "train.lora_rank", "--alpha": "train.lora_alpha",
    "--targets": "train.lora_targets", "--dropout": "train.lora_dropout",
    "--optimizer": "train.optimizer", "--schedule": "train.schedule",
    "--warmup": "train.warmup_steps", "--warmup-fraction": "train.warmup_fraction",
    "--gclip": "train.gclip", "--max-grad-norm": "train.max_grad_norm",
    "--weight-decay": "train.weight_decay", "--checkpoint-interval": "train.checkpoint_interval",
    "--seed": "train.seed"}


def add_queue_options(parser) -> None:
    """--queue, --on and --json: where a run goes and how it reports (train and grpo)."""
    parser.add_argument("--queue", nargs="?", const="", default=None, metavar="QUEUE",
                        help="add the run to the job queue instead of running it here")
    parser.add_argument("--on", metavar="CLUSTER", default=None,
                        help="queue the run to run on this cluster (see: workbench cluster list)")
    parser.add_argument("--json", action="store_true", help="print events as JSON lines")


def add_adapter_options(group) -> None:
    """The LoRA options of TrainConfig (train and grpo)."""
    group.add_argument("--rank", type=int, help="LoRA rank")
    group.add_argument("--expert-rank", type=int, help="rank of the expert adapters (default: "
                       "the rank, at most 8 on models with more than 32 experts)")
    group.add_argument("--alpha", type=float, help="LoRA alpha (scale: alpha / rank)")
    group.add_argument("--targets", help="comma list: attn, ffn, experts, shared, router, output")


def add_optimizer_options(group, optimizers: tuple[str, ...], lr_help: str) -> None:
    """The optimizer, its schedule and clipping (TrainConfig; train and grpo)."""
    group.add_argument("--optimizer", choices=optimizers, help="optimizer")
    group.add_argument("--lr", type=float, help=lr_help)
    group.add_argument("--schedule", choices=("constant", "linear", "cosine"),
                       help="learning-rate schedule after the warmup")
    group.add_argument("--warmup", type=int,
                       help="warmup steps (0: --warmup-fraction of the steps)")
    group.add_argument("--warmup-fraction", type=float, help="warmup over this part of the steps")
    group.add_argument("--gclip", type=float, help="element-wise gradient clip (0: off)")
    group.add_argument("--max-grad-norm", type=float, help="global gradient-norm clip (0: off)")
    group.add_argument("--weight-decay", type=float, help="decoupled weight decay")
    group.add_argument("--checkpoint-interval", type=int,
                       help="gradient checkpointing every N layers")


def add_compute_options(group) -> None:
    """--device, --precision and --weight-cache-mb (TrainConfig.device, .precision,
    .weight_cache_mb): train and grpo."""
    group.add_argument("--device", choices=("cpu", "cuda"),
                       help="where the step computes: cpu (NumPy, default) or cuda (CuPy)")
    group.add_argument("--precision", choices=("auto", "fp32", "bf16"),
                       help="the frozen base's products: auto (default: bf16 where the CPU has "
                       "a bf16 unit, AMX or AVX512-BF16, and the bf16 extra is installed, else "
                       "float32), fp32, or bf16 (emulated, slower, where there is no unit)")
    group.add_argument("--weight-cache-mb", type=int, help="dequantized weights kept in memory "
                       "(default: 40%% of RAM, less where the run would pass two thirds of it; 0: "
                       "dequantize at every use, least memory)")


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
        kind = event.get(events.TYPE)
        if kind == events.STEP:
            self._step_line(event, _progress_line)
        elif kind == events.EVAL:
            self._line(f"eval   step {event['step']}: loss={event['loss']:.5f} "
                       f"acc={100 * event['accuracy']:.2f}% ppl={event['perplexity']:.2f}"
                       + (f" {event['task']}={100 * event['task_acc']:.1f}%"
                          if "task_acc" in event else "")
                       + ("  (best)" if event.get("best") else ""))
        elif kind in (events.LOG, events.START, events.DONE):
            text = event.get("message") or " ".join(
                f"{k}={v}" for k, v in event.items() if k not in (events.TYPE, events.TIME))
            self._line(f"{kind:<6} {text}")

    def _step_line(self, event: dict, line) -> None:
        """A step's progress line `line(event)`: on a terminal at every step, redrawn in place;
        elsewhere every 5 s and at the last step."""
        now = time.monotonic()
        final = event["step"] == event["total_steps"]
        if self.tty or final or now - self.last_print > 5.0:
            end = "\r" if self.tty and not final else "\n"
            self.stream.write(line(event) + end)
            self.stream.flush()
            self.last_print = now

    def _line(self, text: str) -> None:
        prefix = "\n" if self.tty else ""
        self.stream.write(prefix + text + "\n")
        self.stream.flush()


def clock(seconds: float) -> str:
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
            f"lr={e['lr']:.2e} {e['tokens_per_s']:.0f} tok/s t={clock(e['elapsed_s'])} "
            f"ETA={clock(e['eta_s'])}")


def _until_output_lost(printer, run_dir):
    """`printer`, silenced once stdout is gone: its reader went away (`workbench train ... |
    head`) or it cannot be written (`> /mnt/full/log.txt`: app.cli.output's OutputError). The
    run goes on unprinted, as it does in the window, instead of failing on its printing; a
    failed write is said once, on stderr and in the run's log.txt."""
    from contextlib import suppress

    from app.cli.output import OutputError, reason
    from app.engine.errors import EngineError

    gone = False

    def show(event: dict) -> None:
        nonlocal gone
        if not gone:
            try:
                printer(event)
            except BrokenPipeError:
                gone = True
            except (OutputError, OSError) as e:
                gone = True
                what = (e.message if isinstance(e, OutputError)
                        else f"could not write the output: {reason(e)}.")
                note = f"{what} The run goes on; its progress is in {run_dir.metrics_path.name}."
                print(f"warning: {note}", file=sys.stderr)    # dropped if stderr fails too
                with suppress(EngineError, OSError):  # the run's own writes say a full disk
                    run_dir.log(f"progress printing stopped: {note}")
    return show


def run_in_foreground(run_dir, runner, printer) -> int:
    """Run `runner(report, should_stop, checkpoints)` (a train or train_grpo closure) here,
    recording every event in the run directory as a queued job does (through a RunReporter)
    and printing it; Ctrl-C (or SIGTERM) pauses after the step."""
    from app.engine.runs.reporter import RunReporter, failure
    from app.engine.runs.worker import install_stop_signals, restore_signals

    stop = threading.Event()
    reporter = RunReporter(run_dir)
    reporter.started()
    previous = install_stop_signals(stop)
    show = _until_output_lost(printer, run_dir)
    try:
        result = runner(lambda event: show(reporter.report(event)),
                        lambda: "pause" if stop.is_set() else None, run_dir.checkpoints_dir)
    except KeyboardInterrupt:  # a second Ctrl-C: stop now, the last checkpoint stays usable
        reporter.finished("paused")
        return 130
    except BaseException as e:
        reporter.finished("failed", failure(e))
        raise
    finally:
        restore_signals(previous)
    reporter.finished(result)
    if result == "paused":
        print(f"paused: continue with  workbench resume {run_dir.path}", file=sys.stderr)
        return 130
    print(f"run finished: {run_dir.path}", file=sys.stderr)
    return 0


def start_run(args, config: dict, name: str, execute) -> int:
    """Create the run directory (--out, or a dated folder under the runs dir) and either add it
    to the job queue (--queue) or run it here with `execute(run_dir, as_json)`, holding the
    run's lock (app.engine.runs.runlock) from just after its creation to the end. A run here
    that fails (an EngineError) before its first step is taken back (`_take_back_failed_run`)."""
    from app.engine.runs.rundir import RunDir, check_path_length, default_run_name, default_runs_dir
    from app.engine.runs.runlock import RunLock

    out = Path(args.out) if args.out else Path(default_runs_dir()) / default_run_name(name)
    check_path_length(out)   # RunDir.create checks the folder holds no run, nor is in one
    existed = out.exists()
    # the run's files a take-back may remove: only those it makes (a folder that was there may
    # hold a log.txt of the user's own)
    run_files = [p for p in (RunDir(out).status_path, RunDir(out).metrics_path,
                             RunDir(out).log_path) if not p.exists()]
    run_dir = RunDir.create(out, config)
    if args.queue is not None:
        from app.engine.runs.queue import JobQueue

        try:
            job_id = JobQueue(args.queue or None).add(run_dir.path,
                                                      executor=args.on or "local")
        except BaseException:  # the queue refused it: the same command must work next time
            _take_back_failed_run(run_dir, existed, run_files, "the queue refused it")
            raise
        print(f"queued job {job_id}: {run_dir.path}" + (f" on {args.on}" if args.on else ""))
        return 0
    print(f"run directory: {run_dir.path}", file=sys.stderr)
    try:
        with RunLock(run_dir, f"workbench {args.command}"):
            return execute(run_dir, args.json)
    except EngineError:
        if not _trained_anything(run_dir):
            _take_back_failed_run(run_dir, existed, run_files,
                                  "the run failed before its first step")
        raise


def _trained_anything(run_dir) -> bool:
    """Whether a failed run holds something of value: a step done or a checkpoint. When it does
    not (a model, adapter or dataset refused while the run prepared), the folder is taken back
    (`_take_back_failed_run`)."""
    from app.engine.training.events import STEP, event_type

    try:
        return (any(run_dir.checkpoints_dir.iterdir())
                or any(event_type(e) == STEP for e in run_dir.metrics()))
    except (OSError, EngineError):
        return True  # cannot tell: keep it


def _take_back_failed_run(run_dir, existed: bool, run_files: list[Path], why: str) -> None:
    """A run that failed before its first step (or that the queue refused: `why`) made nothing
    worth keeping: remove what this command made (the folder, or in a folder that was there
    before, the run's files in it) and its line in the list of runs, so that the same
    command, its input fixed, works next time (issue 28: "A command that fails before
    training starts removes the run folder it made"). The error itself is printed by the
    caller. Best effort: never raises."""
    from contextlib import suppress

    from app.engine.runs.registry import forget_run

    if existed:  # what the run wrote beside config.json (take_back removes that and the rest)
        for path in run_files:
            with suppress(OSError):
                path.unlink()
    run_dir.take_back(existed)
    with suppress(EngineError, OSError):
        forget_run(run_dir.path)
    print(f"removed the run folder {run_dir.path}: {why}" if not existed
          else f"removed the run's files from {run_dir.path}: {why}", file=sys.stderr)
