"""An evaluation as a queue job: the engine process (the queue's worker) runs it, with progress,
pause/cancel and the run's evals.jsonl written only when it has finished.

The job's folder is `RUN_DIR/evals/<id>/` (`new_eval_job`), with a config.json of kind "eval"
(`EvalConfig`): the model, the targets (the base, adapters with their labels and scales), the
task specs and the options of `workbench eval`. The worker calls `run_eval_job(run_dir,
control)` (the runner contract of app.engine.runs.worker): it loads the model once, evaluates
every target on every task, writes the job's own evals.jsonl and then appends the same lines
to the run's (RUN_DIR/evals.jsonl) under the run's writer lock, given by the caller as
`lock_run` (the runs layer owns the lock). A cancel or pause stops between task packs and
writes nothing: an evaluation is short, it starts again from the beginning.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from app.engine.errors import Cancelled, ConfigError
from app.engine.evaluation import runner, store, suites
from app.engine.runtime.files import atomic_write_json
from app.engine.training import events

KIND = "eval"
PROGRESS_EVERY_S = 1.0        # log lines and status.json updates at most this often


@dataclass
class EvalConfig:
    model: str
    tasks: list[str]
    targets: list[dict] = field(default_factory=lambda: [{"label": "base"}])
    limit: int | None = None
    samples: int = 1
    seed: int | None = None
    max_new_tokens: int = 64
    ctx: int = 512

    @classmethod
    def from_dict(cls, raw: dict) -> "EvalConfig":
        raw = {k: v for k, v in raw.items() if k != "kind"}
        unknown = sorted(set(raw) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"Unknown evaluation settings: {', '.join(unknown)}.")
        try:
            config = cls(**raw)
        except TypeError as e:
            raise ConfigError(f"An evaluation's config.json is incomplete: {e}.") from None
        config.validate()
        return config

    def to_dict(self) -> dict:
        return {"kind": KIND, **asdict(self)}

    def validate(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("An evaluation needs a model.")
        if not isinstance(self.tasks, list) or not self.tasks:
            raise ConfigError("An evaluation needs at least one task.")
        for spec in self.tasks:
            runner.parse_task(spec)
        labels = [t.get("label") for t in self.targets if isinstance(t, dict)]
        if (len(labels) != len(self.targets) or len(set(labels)) != len(labels)
                or not all(isinstance(x, str) and x for x in labels)):
            raise ConfigError("Each evaluated model needs its own label.")
        for name in ("samples", "max_new_tokens", "ctx"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a whole number of at least 1.")
        if self.limit is not None and (isinstance(self.limit, bool)
                                       or not isinstance(self.limit, int) or self.limit < 1):
            raise ConfigError("limit must be a whole number of at least 1.")


def new_eval_job(run_dir: str | Path, config: EvalConfig) -> Path:
    """Make RUN_DIR/evals/<id>/ with the config: the folder to queue."""
    config.validate()
    folder = Path(run_dir) / "evals" / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    folder.mkdir(parents=True)
    atomic_write_json(folder / "config.json", config.to_dict())
    return folder


def run_eval_job(run_dir, control, lock_run: Callable | None = None) -> str:
    """The worker's runner for an evaluation folder (see the module's doc)."""
    from app.engine.model.lora import load_adapter
    from app.engine.model.transformer import load_model

    config = EvalConfig.from_dict(run_dir.config())
    specs = [runner.parse_task(t) for t in config.tasks]
    loaded = runner.load_tasks(specs, config.limit)
    for task in loaded:
        if task.spec.kind == "suite":
            suites.check_trust(task.items)
    model = load_model(config.model)
    targets = [runner.Target(t["label"], load_adapter(t["adapter"]) if t.get("adapter") else None,
                             float(t.get("scale", 1.0))) for t in config.targets]
    total = len(targets) * len(loaded)
    state = {"last": 0.0, "done": 0}

    def progress(label: str, task: str, done: int, of: int) -> None:
        now = time.monotonic()
        if now - state["last"] >= PROGRESS_EVERY_S or done == of:
            state["last"] = now
            control.report(events.LOG_EVENT(message=f"{label} {task}: {done}/{of}"))
            run_dir.write_status(step=state["done"] + (done == of), total_steps=total)
            if done == of:
                state["done"] += 1

    try:
        results = runner.evaluate(model, targets, loaded, n_ctx=config.ctx,
                                  samples=config.samples, seed=config.seed,
                                  max_new_tokens=config.max_new_tokens, progress=progress,
                                  should_stop=control.should_stop)
    except Cancelled:
        request = control.should_stop()
        return "paused" if request == "pause" else "cancelled"
    adapters = {t["label"]: t.get("adapter") for t in config.targets}
    names = {s.name: s.to_text() for s in specs}
    saved = store.save_evals(run_dir.path, results, adapters, names)
    parent = Path(run_dir.path).parent.parent
    if Path(run_dir.path).parent.name == "evals" and (parent / "config.json").is_file():
        lock = lock_run(parent) if lock_run is not None else None
        try:
            store.save_evals(parent, results, adapters, names, *saved)
        finally:
            if lock is not None:
                lock.release()
    return "done"
