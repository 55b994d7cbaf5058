"""`workbench eval`: a model, its base and any adapters, over tasks (app.engine.evaluation):
multiple-choice benchmarks scored as llama.cpp's `llama-perplexity --hellaswag | --winogrande |
--multiple-choice` scores them, prompt suites scored by reward functions, and perplexity of a
text chunked as `llama-perplexity -c N` (app.engine.evaluation.perplexity), so the numbers
compare with llama.cpp's.

`-f FILE` alone is the perplexity command it always was (one adapter at most, one line out);
`--task SPEC` (repeatable) prints one row per model (the base first, then each adapter) and one
column per task, all from one model load."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def add_eval_parser(sub) -> None:
    from app.engine.evaluation import SPEC_HELP

    p = sub.add_parser("eval", help="benchmark tasks, prompt suites and perplexity, base and "
                                    "adapters side by side (as llama-perplexity scores them)")
    p.add_argument("--model", "-m", required=True, help="GGUF model file")
    p.add_argument("--adapter", "-a", action="append", default=[],
                   help="GGUF LoRA adapter file or PEFT folder (repeatable: each is a row beside "
                        "the base)")
    p.add_argument("--scale", "-s", type=float, default=1.0,
                   help="adapter user scale (default 1.0)")
    p.add_argument("--file", "-f", help="UTF-8 text file: its perplexity (as llama-perplexity)")
    p.add_argument("--task", "-t", action="append", default=[], metavar="SPEC",
                   help=f"a task (repeatable): {SPEC_HELP}")
    p.add_argument("--limit", type=int, help="the first N items of each task file")
    p.add_argument("--ctx", "-c", type=int, default=512,
                   help="tokens per chunk for perplexity (llama-perplexity -c; default 512)")
    p.add_argument("--samples", type=int, default=1,
                   help="prompt suites: answers per prompt (default 1, greedy; more: sampled "
                        "at temperature 1)")
    p.add_argument("--seed", type=int, help="prompt suites: the first sample's seed (default 0)")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="prompt suites: tokens per answer (default 64)")
    p.add_argument("--trust-reward-code", action="store_true",
                   help="run the Python reward files a suite names")
    p.add_argument("--save", metavar="RUN_DIR",
                   help="also append the results to RUN_DIR/evals.jsonl (all or nothing)")
    p.add_argument("--queue", nargs="?", const="", default=None, metavar="QUEUE",
                   help="with --save: add the evaluation to the job queue (its folder: "
                        "RUN_DIR/evals/<id>/) instead of running it here")
    p.add_argument("--json", action="store_true",
                   help="print the results as JSON, with one record per task item")


def cmd_eval(args) -> int:
    from app.engine.errors import ConfigError

    if not args.task and not args.file:
        raise ConfigError("Nothing to evaluate.", "Give --task SPEC (repeatable) or -f TEXT.")
    if args.file and not args.task and not args.save:
        return _perplexity(args)
    if args.file:
        args.task.append(f"ppl:{args.file}")
    if args.limit is not None and args.limit < 1:
        raise ConfigError("--limit must be at least 1.")
    return _tasks(args)


def _perplexity(args) -> int:
    """`workbench eval -f TEXT [-a ADAPTER]`: one perplexity, printed as it always was."""
    from app.engine.errors import ConfigError
    from app.engine.evaluation.perplexity import perplexity
    from app.engine.export.exporter import import_adapter
    from app.engine.model.transformer import load_model

    if len(args.adapter) > 1:
        raise ConfigError("Perplexity with -f takes one adapter.",
                          "Use --task ppl:FILE to compare several.")
    model = load_model(args.model)
    adapter = import_adapter(args.adapter[0], model) if args.adapter else None

    def progress(done: int, total: int) -> None:
        if not args.json:
            print(f"\rchunk {done}/{total}", end="" if done < total else "\n", file=sys.stderr,
                  flush=True)

    result = perplexity(model, args.file, args.ctx, adapter, args.scale, progress)
    print(json.dumps(result.to_dict()) if args.json else result.to_text())
    return 0


def adapter_labels(paths: list[str]) -> list[str]:
    """Each adapter's row name: its file name, or its run's folder for a run's adapter.gguf
    (`run-7/adapter.gguf` -> `run-7`), made unique."""
    out: list[str] = []
    for p in paths:
        path = Path(p)
        label = path.parent.name if path.name == "adapter.gguf" and path.parent.name else path.name
        label = label or p
        while label in out or label == "base":
            label = f"{label}'"
        out.append(label)
    return out


def _tasks(args) -> int:
    from app.engine.evaluation import runner, suites
    from app.engine.export.exporter import import_adapter
    from app.engine.model.transformer import load_model

    specs = [runner.parse_task(t) for t in args.task]
    loaded = runner.load_tasks(specs, args.limit)          # every file checked before the load
    if args.queue is not None:
        return _queue(args)
    for task in loaded:
        if task.spec.kind == "suite":
            suites.check_trust(task.items, args.trust_reward_code)
    model = load_model(args.model)
    targets = [runner.Target("base")]
    for label, path in zip(adapter_labels(args.adapter), args.adapter):
        targets.append(runner.Target(label, import_adapter(path, model), args.scale))

    def progress(label: str, task: str, done: int, total: int) -> None:
        if not args.json and sys.stderr.isatty():
            print(f"\r{label} {task}: {done}/{total}   ", end="", file=sys.stderr, flush=True)

    lock = _run_lock(args.save) if args.save else None     # refused if the run is busy
    try:
        results = runner.evaluate(model, targets, loaded, n_ctx=args.ctx,
                                  samples=args.samples, seed=args.seed,
                                  max_new_tokens=args.max_new_tokens, progress=progress)
        if lock is not None:
            from app.engine.evaluation.store import save_evals
            save_evals(args.save, results,
                       {"base": None, **{label: os.path.abspath(p) for label, p in
                                        zip(adapter_labels(args.adapter), args.adapter)}},
                       {s.name: s.to_text() for s in specs})
    finally:
        if lock is not None:
            lock.release()
    if not args.json and sys.stderr.isatty():
        print(file=sys.stderr)
    if args.json:
        print(json.dumps({
            "models": {label: [r.to_dict() for r in rows] for label, rows in results.items()},
            "records": [{"model": label, **rec} for label, rows in results.items()
                        for r in rows for rec in r.records]}))
    else:
        print(runner.table(results))
    return 0


def _run_lock(path: str):
    """The run's writer lock, for saving evals.jsonl in it (RunBusyError while it trains)."""
    from app.engine.errors import ConfigError
    from app.engine.runs.rundir import RunDir
    from app.engine.runs.runlock import RunLock

    run = RunDir(path)
    if not run.config_path.is_file():
        raise ConfigError(f"{path} is not a run folder (no config.json).",
                          "Give --save the folder of a run.")
    return RunLock(run, "workbench eval --save").acquire()


def _queue(args) -> int:
    """`--queue`: the evaluation as a job of the queue's worker (app.engine.evaluation.job)."""
    from app.engine.errors import ConfigError
    from app.engine.evaluation.job import EvalConfig, new_eval_job
    from app.engine.runs.queue import JobQueue

    if not args.save:
        raise ConfigError("--queue saves the evaluation with a run.", "Add --save RUN_DIR.")
    _run_lock(args.save).release()                 # a run folder, not busy now
    targets = [{"label": "base"}] + [
        {"label": label, "adapter": os.path.abspath(path), "scale": args.scale}
        for label, path in zip(adapter_labels(args.adapter), args.adapter)]
    config = EvalConfig(os.path.abspath(args.model), [_absolute(t) for t in args.task], targets,
                        args.limit, args.samples, args.seed, args.max_new_tokens, args.ctx)
    folder = new_eval_job(args.save, config)
    job_id = JobQueue(args.queue or None).add(folder)
    print(f"queued job {job_id}: {folder}")
    return 0


def _absolute(spec: str) -> str:
    """A task spec with its file's absolute path (the worker runs elsewhere in the tree)."""
    from app.engine.evaluation.runner import parse_task

    task = parse_task(spec)
    return f"{task.kind}:{os.path.abspath(task.path)}"
