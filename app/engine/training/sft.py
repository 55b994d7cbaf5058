"""The training run: epochs of steps over a dataset, evaluation, checkpoints, exact resume.

`train(config, report, should_stop, run_dir)` knows nothing of queues or GUIs: it reports
events (dicts) through `report` and asks `should_stop()` between steps. A run with `workers`
N > 1 is N calls of `train`, one per rank, each with a communicator
(app.engine.training.communicator; app.engine.runs.data_parallel starts them): a step takes N x
grad_accum windows, each rank computes its share, and rank 0 alone reports, answers
should_stop (for every rank) and reads and writes the checkpoints. `run_sft_job` adapts it to
the worker's runner contract (app.engine.runs.worker). Everything a run needs is in `RunConfig`,
saved as the run directory's config.json, so a run can always be repeated or resumed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

import numpy as np

from app.engine.runtime.backend import memory_report, peak_rss_mb
from app.engine.training.checkpoints import (nested_runs, newest_intact, own_folder,
                                             prune_checkpoints, restart_hint, save_checkpoint,
                                             set_aside)
from app.engine.training.communicator import Communicator, SingleProcess
from app.engine.training.config import TrainConfig
from app.engine.training.memory import check_run_memory, run_cache_budget
from app.engine.runtime.schema import AT_LEAST_0, AT_LEAST_1, TEXT, check
from app.engine.training import events, fingerprints
from app.engine.data.dataset import DataConfig, load_dataset
from app.engine.errors import (Cancelled, CheckpointError, ConfigError, DatasetError,
                               EngineError, OutOfMemoryError)
from app.engine.io.gguf import dequantize
from app.engine.model.lora import adapter_norms, load_adapter, save_adapter
from app.engine.model.transformer import load_model
from app.engine.training.session import TrainSession

Report = Callable[[dict], None]
ShouldStop = Callable[[], "str | None"]


class TrainingDiverged(EngineError):
    kind = "diverged"


KIND = events.SFT_RUN

# The schema rules of the settings every run kind has (RunConfig, GrpoConfig).
RUN_LENGTHS = dict(eval_every=AT_LEAST_0, save_every=AT_LEAST_0, norms_every=AT_LEAST_0,
                   keep_last=AT_LEAST_1, max_bad_steps=AT_LEAST_1, adapter=TEXT)


@dataclass(frozen=True)
class RunConfig:
    """One run, completely: `epochs` passes over the data, capped at `max_steps` optimizer
    steps when that is set (epochs 0: exactly max_steps steps, cycling through the data).
    train.max_steps is derived from these (it sets the schedule's length). With `workers` N a
    step takes N x train.grad_accum windows: the same steps as one worker with N times the
    grad_accum."""

    model: str
    data: str
    train: TrainConfig = field(default_factory=TrainConfig)
    data_config: DataConfig = field(default_factory=DataConfig)
    epochs: int = 1
    max_steps: int = 0           # 0: no cap
    eval_every: int = 0          # steps between evaluations (0: at the end of each epoch)
    save_every: int = 0          # steps between checkpoints (0: at the end of each epoch)
    keep_last: int = 2           # checkpoints kept, plus the best
    patience: int = 0            # stop after this many evaluations without improvement (0: off)
    norms_every: int = 10        # steps between LoRA-norm and routing events
    max_bad_steps: int = 5       # consecutive NaN/Inf steps before the run stops
    adapter: str | None = None   # start from an existing GGUF LoRA adapter
    workers: int = 1             # data-parallel ranks (> 1: app.engine.runs.data_parallel)
    eval_task: str = ""          # a multiple-choice task scored at every evaluation (issue 32)
    eval_task_limit: int = 50    # its first N items
    best_by: str = "loss"        # the best checkpoint: "loss" (validation) or "task" (eval_task)

    SCHEMA_RULES: ClassVar[dict] = dict(  # "kind" is not a field: config.json names the run's type
        kind=(KIND,), model=TEXT, data=TEXT, epochs=AT_LEAST_0, max_steps=AT_LEAST_0,
        patience=AT_LEAST_0, workers=AT_LEAST_1, eval_task=TEXT, eval_task_limit=AT_LEAST_1,
        best_by=("loss", "task"),
        **RUN_LENGTHS)

    def validate(self) -> None:
        self.train.validate()
        self.data_config.validate()
        for name in ("epochs", "max_steps", "eval_every", "save_every", "patience",
                     "norms_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative.")
        if not self.epochs and not self.max_steps:
            raise ConfigError("A run needs a number of epochs or of steps.",
                              "Set epochs, or max_steps with epochs 0.")
        if self.keep_last < 1 or self.max_bad_steps < 1:
            raise ConfigError("keep_last and max_bad_steps must be at least 1.")
        if self.best_by == "task" and not self.eval_task:
            raise ConfigError("best_by task needs an evaluation task.",
                              "Give eval_task (--eval-task SPEC), or keep best_by loss.")
        if self.eval_task and self.workers > 1:
            raise ConfigError("An evaluation task is scored by one process: a data-parallel run "
                              "(workers > 1) cannot take one.", "Leave eval_task empty.")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["train"] = {k: list(v) if isinstance(v, tuple) else v for k, v in d["train"].items()}
        d["data_config"] = self.data_config.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        """From a config.json dict; every unknown key, wrong type or value out of range is
        listed in one ConfigError (app.engine.runtime.schema)."""
        check(d, cls)
        d = dict(d)
        d.pop("kind", None)
        train = TrainConfig.from_dict(d.pop("train", {}))
        return cls(train=train,
                   data_config=DataConfig.from_dict(d.pop("data_config", {})), **d)


class _RunningStats:
    """Mean loss and token accuracy of the epoch so far with standard errors, as ggml-opt."""

    def __init__(self):
        self.losses: list[float] = []
        self.correct = self.tokens = 0

    def add(self, loss: float, accuracy: float, tokens: int) -> None:
        self.losses.append(loss)
        self.correct += accuracy * tokens
        self.tokens += tokens

    def summary(self) -> dict:
        n = len(self.losses)
        loss = float(np.mean(self.losses)) if n else math.nan
        loss_se = float(np.std(self.losses, ddof=1) / math.sqrt(n)) if n > 1 else 0.0
        acc = self.correct / self.tokens if self.tokens else 0.0
        acc_se = math.sqrt(acc * (1 - acc) / (self.tokens - 1)) if self.tokens > 1 else 0.0
        return {"epoch_loss": loss, "epoch_loss_se": loss_se, "epoch_accuracy": acc,
                "epoch_accuracy_se": acc_se}


def run_inputs(config: RunConfig) -> dict[str, str | None]:
    """The run's input files by what they are (fingerprinted in its checkpoints)."""
    return {"model": config.model, "dataset": config.data,
            "validation data": config.data_config.val_path,
            "weights file": config.data_config.weights_path, "adapter": config.adapter}


PROGRESS_EVERY_S = 2.0   # a tokenizing progress event at most this often


def tokenizing_progress(report: Report, name: str) -> Callable[[int, int, int], None]:
    """A `load_dataset` progress callback that reports a log event ("tokenizing chat.jsonl:
    12,000 rows, 20 of 60 MB") at most every PROGRESS_EVERY_S seconds: the CLI prints it, the
    window's log shows it."""
    last = time.monotonic()

    def progress(rows: int, done: int, size: int) -> None:
        nonlocal last
        if time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            report(events.LOG_EVENT(message=f"tokenizing {name}: {rows:,} rows, "
                                            f"{done / 2**20:.0f} of {size / 2**20:.0f} MB"))
    return progress


def before_training(load: Callable, should_stop: ShouldStop):
    """(load(ask), None), or (None, "paused" | "cancelled") when a stop request ended `load`:
    reading the run's files asks `ask` (should_stop, its answer kept) as it goes and raises
    Cancelled (app.engine.runtime.inputs.StopCheck). Nothing is trained yet then, so the run
    stops at once, and resuming it starts over."""
    answer = None

    def ask():
        nonlocal answer
        answer = should_stop()
        return answer
    try:
        return load(ask), None
    except Cancelled:
        if not answer:
            raise
        return None, "cancelled" if answer == "cancel" else "paused"


def train(config: RunConfig, report: Report, should_stop: ShouldStop,
          checkpoints: str | Path | None = None, communicator: Communicator | None = None,
          allow_changed_inputs: bool = False,
          on_eval: Callable[[TrainSession], dict] | None = None) -> str:
    """Run (or resume, from the newest checkpoint in `checkpoints`) a training run.

    Returns "done", "paused" or "cancelled". Events: start, step, eval, norms, routing,
    checkpoint, log, done (their fields: app.engine.training.events). Raises EngineError
    subclasses for bad input, InputChanged when a resumed run's model or data changed since its
    checkpoint (unless `allow_changed_inputs`: app.engine.training.fingerprints) and
    TrainingDiverged after `max_bad_steps` consecutive non-finite steps. With a `communicator`
    of config.workers ranks this is one rank of a data-parallel run: only rank 0's `report`,
    `should_stop` and `checkpoints` are used. `on_eval(session)`: more fields for every eval
    event (rank 0), e.g. a task's accuracy (app.engine.evaluation.during_training).
    """
    config.validate()
    comm = communicator or SingleProcess()
    if comm.world_size != config.workers:
        raise ConfigError(f"This run has workers {config.workers}: it trains data-parallel as "
                          f"{config.workers} Ray workers, but was started as {comm.world_size}.",
                          "Send it to a Ray cluster, or set workers to 1 to train in one process.")
    lead = comm.rank == 0
    if not lead:   # rank 0 alone reports and hears stop requests (broadcast between steps)
        report, should_stop = (lambda event: None), (lambda: None)
    t_start = time.perf_counter()
    inputs = fingerprints.check_inputs(checkpoints, run_inputs(config), report,
                                       allow_changed_inputs) if lead else {}
    # wherever it runs (a queue's worker, the window, a cluster's node): this machine's memory
    check_run_memory(config.model, config.train, config.data_config.context)
    model = load_model(config.model,
                       run_cache_budget(config.model, config.train, config.data_config.context),
                       config.train.device)
    name = Path(config.data).name
    report(events.LOG_EVENT(message=f"tokenizing {name}"))
    dataset, stopped = before_training(
        lambda ask: load_dataset(config.data, model.tokenizer, config.data_config,
                                 progress=tokenizing_progress(report, name), should_stop=ask),
        should_stop)
    if stopped:
        return stopped
    if dataset.rejections.total:
        report(events.LOG_EVENT(message=dataset.rejections.summary()))
    tc = config.train
    windows_per_step = tc.grad_accum * comm.world_size
    steps_per_epoch = dataset.steps_per_epoch(windows_per_step)
    if steps_per_epoch == 0:
        raise DatasetError(f"{Path(config.data).name} gives no training windows.",
                           "Check the linter's report: every row may have been rejected.")
    total = config.epochs * steps_per_epoch if config.epochs else config.max_steps
    if config.max_steps:
        total = min(total, config.max_steps)
    n_epochs = config.epochs or math.ceil(total / steps_per_epoch)
    adapter = load_adapter(config.adapter) if config.adapter else None
    session = TrainSession(model, tc.for_steps(total), adapter, comm)
    state = {"epoch": 0, "step_in_epoch": 0, "best_loss": math.inf, "best_step": 0,
             "evals_without_gain": 0, "bad_streak": 0, "skipped_steps": 0}
    ckpt_dir = resume(session, checkpoints, state, report) if lead else None
    state[fingerprints.STATE_KEY] = inputs     # what the checkpoints from now on record
    if comm.world_size > 1:   # every rank continues from rank 0's state (resumed or fresh)
        trained, run_state = comm.broadcast((session.state_dict(), state) if lead else None)
        if not lead:
            session.load_state_dict(trained)
            state.update(run_state)
    stats = dataset.stats
    report(events.SFT_START(total_steps=total, epochs=n_epochs, steps_per_epoch=steps_per_epoch,
                            trainable=session.n_trainable, train_rows=stats.train_rows,
                            val_rows=stats.val_rows, skipped_rows=stats.rejected,
                            resumed_at=session.step_count,
                            precision=session.precision.reason))
    has_val = bool(dataset.val_batches())
    if on_eval is not None and not has_val:
        raise ConfigError("The evaluation task runs at every evaluation, and this run has none.",
                          "Give it a validation split (--val-split or --val-data).")

    save = checkpoint_saver(ckpt_dir, session, state, config.keep_last, report)

    def evaluate() -> bool:
        """Evaluate; True when early stopping says stop."""
        if not has_val:
            return False
        loss, acc = session.evaluate(dataset.val_batches())
        extra = on_eval(session) if on_eval is not None and lead else {}
        if config.best_by == "task" and "task_acc" in extra:   # the task's accuracy decides
            improved = extra["task_acc"] > state.get("best_task_acc", -1.0)
        else:
            improved = loss < state["best_loss"]
        if improved:
            state.update(best_loss=loss, best_step=session.step_count, evals_without_gain=0,
                         **({"best_task_acc": extra["task_acc"]} if "task_acc" in extra else {}))
        else:
            state["evals_without_gain"] += 1
        report(events.SFT_EVAL(step=session.step_count, loss=loss, accuracy=acc,
                               perplexity=math.exp(min(loss, 700.0)), best=improved, **extra))
        if improved and ckpt_dir is not None:
            save("best")
        return bool(config.patience and state["evals_without_gain"] >= config.patience)

    routing_window: dict[int, np.ndarray] = {}
    stop_reason = None
    session_start_step, t_loop = session.step_count, time.perf_counter()
    while session.step_count < total and stop_reason is None:
        epoch = state["epoch"]
        running = _RunningStats()
        for micro in dataset.train_batches(epoch, windows_per_step, state["step_in_epoch"]):
            if session.step_count >= total:
                break
            metrics, bad = guarded_step(
                session, micro, state, config.max_bad_steps,
                oom_hint="Lower the context or the batch, set checkpoint-interval 1 (gradient "
                         "checkpointing), use LoRA instead of full fine-tuning, or a smaller rank.",
                diverged_hint="Lower the learning rate, set gclip (e.g. 1.0), or check the data.")
            state["step_in_epoch"] += 1
            if not bad:
                running.add(metrics.loss, metrics.accuracy, metrics.tokens)
            for layer, counts in metrics.routing.items():
                routing_window[layer] = routing_window.get(layer, 0) + counts
            done_steps = session.step_count - session_start_step
            elapsed = time.perf_counter() - t_loop
            eta = elapsed / done_steps * (total - session.step_count) if done_steps else 0.0
            report(events.SFT_STEP(
                step=session.step_count, total_steps=total, epoch=epoch + 1, epochs=n_epochs,
                loss=metrics.loss, accuracy=metrics.accuracy, lr=metrics.lr,
                grad_norm=metrics.grad_norm, clipped_fraction=metrics.clipped_fraction,
                tokens=metrics.tokens, tokens_per_s=metrics.tokens_per_s, skipped=bad,
                elapsed_s=time.perf_counter() - t_start, eta_s=eta, rss_mb=peak_rss_mb(),
                **running.summary()))
            step = session.step_count
            if config.norms_every and step % config.norms_every == 0:
                report_norms(report, session, routing_window, step)
                routing_window = {}
            stop_early = bool(config.eval_every and step % config.eval_every == 0) and evaluate()
            if config.save_every and step % config.save_every == 0:
                save()
            if stop_early:
                stop_reason = "early_stop"
                break
            requested = comm.broadcast(should_stop() if lead else None)
            if requested:
                stop_reason = "cancelled" if requested == "cancel" else "paused"
                break
        else:  # the epoch ran out
            state.update(epoch=epoch + 1, step_in_epoch=0)
            if not config.eval_every and evaluate():
                stop_reason = "early_stop"
            if not config.save_every:
                save("epoch")
    if stop_reason in ("paused", "cancelled"):
        save(stop_reason)
        return stop_reason
    if config.eval_every and session.step_count % config.eval_every:
        evaluate()
    save("final")
    if session.adapter is not None and ckpt_dir is not None:
        save_adapter(session.adapter, ckpt_dir.parent / "adapter.gguf", model.config.arch)
    report(events.SFT_DONE(
        step=session.step_count, reason=stop_reason or "finished", best_step=state["best_step"],
        best_loss=state["best_loss"] if math.isfinite(state["best_loss"]) else None,
        skipped_steps=state["skipped_steps"], elapsed_s=time.perf_counter() - t_start))
    return "done"


def resume(session: TrainSession, checkpoints, state: dict, report: Report) -> Path | None:
    """The run's checkpoint folder (None without one). When it holds checkpoints, the newest
    intact one is loaded into `session` and its saved run state into `state`, and a log event
    says so. Damaged newer ones are set aside (renamed `step-<N>.damaged`, so that pruning and
    export skip them), each with a log event; when none is intact, CheckpointError."""
    ckpt_dir = own_folder(checkpoints) if checkpoints else None   # a link: refused up front
    ckpt, damaged = newest_intact(ckpt_dir) if ckpt_dir is not None else (None, [])
    for nested in nested_runs(ckpt_dir) if ckpt_dir is not None else ():
        report(events.LOG_EVENT(message=f"checkpoints/{nested.name} holds a run (its "
                                        "config.json), not a checkpoint: left as it is"))
    if ckpt is not None:
        session.load_state_dict(ckpt.state)
        state.update(ckpt.meta.get("run", {}))
        for bad, reason in damaged:
            kept = set_aside(bad, "damaged")
            report(events.LOG_EVENT(message=f"checkpoint {bad.name} is damaged ({reason}); "
                                            f"resuming from {ckpt.path.name} (kept as "
                                            f"{kept.name})"))
        report(events.LOG_EVENT(message=f"resumed from step {session.step_count}"))
        return ckpt_dir
    if damaged:
        raise CheckpointError("No checkpoint of the run is intact: "
                              + "; ".join(f"{p.name} is damaged ({why})" for p, why in damaged)
                              + ".", restart_hint(ckpt_dir))
    return ckpt_dir


def checkpoint_saver(ckpt_dir: Path | None, session: TrainSession, state: dict, keep_last: int,
                     report: Report) -> Callable[..., None]:
    """save(tag=""): a checkpoint of the session with the run's `state` (its best step is kept
    when older ones are pruned) and its event; nothing without a checkpoint folder."""
    def save(tag: str = "") -> None:
        if ckpt_dir is None:
            return
        save_checkpoint(ckpt_dir, session.step_count, session.state_dict(copy=False),
                        {"run": dict(state)})
        prune_checkpoints(ckpt_dir, keep_last, keep=(state["best_step"],))
        report(events.CHECKPOINT_EVENT(step=session.step_count, tag=tag))
    return save


def between_steps(config, session: TrainSession, report: Report, routing: dict,
                  evaluate: Callable[[], None], save: Callable[..., None],
                  should_stop: ShouldStop) -> tuple[dict, str | None]:
    """After a step of a GRPO or preference run: the norms and routing events every
    config.norms_every steps, an evaluation every eval_every, a checkpoint every save_every,
    then the stop request. Returns (the routing window, emptied when reported; None, or
    "paused" or "cancelled" when a stop was asked)."""
    done = session.step_count
    if config.norms_every and done % config.norms_every == 0:
        report_norms(report, session, routing, done)
        routing = {}
    if config.eval_every and done % config.eval_every == 0:
        evaluate()
    if config.save_every and done % config.save_every == 0:
        save()
    requested = should_stop()
    return routing, (None if not requested else "cancelled" if requested == "cancel"
                     else "paused")


def finish_run(stop_reason: str | None, state: dict, session: TrainSession,
               ckpt_dir: Path | None, evaluate: Callable[[], None],
               save: Callable[..., None]) -> str | None:
    """The end of a GRPO or preference run: a pause or cancel saves a checkpoint tagged with it
    and is returned; else an evaluation unless the last step had one, the final checkpoint and
    the adapter beside the checkpoints (adapter.gguf), and None."""
    if stop_reason in ("paused", "cancelled"):
        save(stop_reason)
        return stop_reason
    if state["last_eval_step"] != session.step_count:
        evaluate()
    save("final")
    if session.adapter is not None and ckpt_dir is not None:
        save_adapter(session.adapter, ckpt_dir.parent / "adapter.gguf",
                     session.model.config.arch)
    return None


def guarded_step(session: TrainSession, batches, state: dict, max_bad_steps: int,
                 oom_hint: str, diverged_hint: str):
    """One optimizer step of a run: (metrics, bad). Running out of memory becomes an
    OutOfMemoryError that names the device's memory; a NaN/Inf step is counted in
    state["bad_streak"] / state["skipped_steps"], and max_bad_steps of them in a row raise
    TrainingDiverged.

    A NaN/Inf weight skips every step that uses it; when only some batches use it (an
    embedding row, one expert) the run would otherwise finish with most of its steps skipped
    and no error. No step can repair such a weight, so the run's first skipped step looks for them (one pass over the
    weights, paid only then rather than by every run at load) and raises TrainingDiverged
    naming the tensors.

    The model file is checked first (ModelFileChanged when it was truncated, rewritten or
    replaced): weights cached in memory would let the step run on, on a model that is no longer
    the file's."""
    session.model.gguf.check_unchanged()
    try:
        metrics = session.step(batches)
    except MemoryError:
        raise OutOfMemoryError(f"Out of memory at step {session.step_count + 1} "
                               f"({memory_report(session.model.xp)}).", oom_hint) from None
    bad = metrics.skipped or not math.isfinite(metrics.loss)
    state["bad_streak"] = state["bad_streak"] + 1 if bad else 0
    state["skipped_steps"] += int(bad)
    if bad and state["skipped_steps"] == 1:
        in_file, trained = non_finite_tensors(session)
        if in_file or trained:
            names = sorted(set(in_file + trained))
            raise TrainingDiverged(
                f"The weights {', '.join(names[:5])}"
                + (f" and {len(names) - 5} more" if len(names) > 5 else "")
                + " hold NaN/Inf values: every step that uses them is skipped (the first: "
                f"step {session.step_count}).",
                "The model file is damaged or was converted wrongly: use another copy of it."
                if in_file else
                "The trained tensors (or the adapter the run continues) hold them. "
                + diverged_hint)
    if state["bad_streak"] >= max_bad_steps:
        raise TrainingDiverged(f"The loss or gradients were NaN/Inf for {state['bad_streak']} "
                               f"steps in a row (step {session.step_count}).", diverged_hint)
    return metrics, bad


def non_finite_tensors(session: TrainSession) -> tuple[list[str], list[str]]:
    """(the model file's tensors, the session's trained tensors) that hold NaN or Inf."""
    gguf, xp = session.model.gguf, session.model.xp
    in_file = []
    for name, info in gguf.tensors.items():
        rows = gguf.raw(name).reshape(-1, info.row_bytes)
        if not all(np.isfinite(dequantize(rows[i:i + 1024], info.ggml_type)).all()
                   for i in range(0, len(rows), 1024)):
            in_file.append(name)
    trained = [n for n, a in session.trainable.items() if not bool(xp.isfinite(a).all())]
    return in_file, trained


def report_norms(report: Report, session: TrainSession, routing: dict, step: int) -> None:
    if session.adapter is not None:
        report(events.NORMS_EVENT(step=step, tensors=adapter_norms(session.adapter)))
    if routing:
        report(events.ROUTING_EVENT(step=step, layers={
            str(layer): (counts / max(counts.sum(), 1)).tolist()
            for layer, counts in sorted(routing.items())}))


def run_sft_job(run_dir, control, task_evaluator: Callable | None = None) -> str:
    """The worker's runner for a supervised run directory (config.json with "kind": "sft", or
    none): train its config, resuming from its checkpoints. `task_evaluator(config)`: the
    run's `on_eval` (its eval_task; app.engine.runs.kinds passes the evaluation layer's)."""
    raw = dict(run_dir.config())
    raw.pop("kind", None)
    config = RunConfig.from_dict(raw)
    on_eval = task_evaluator(config) if task_evaluator is not None else None
    return train(config, control.report, control.should_stop, run_dir.checkpoints_dir,
                 on_eval=on_eval)
