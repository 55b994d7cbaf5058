"""The `workbench` command line: parse, call the engine's public API, print. No Qt here."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import sys
import time
import traceback

import numpy as np

from app.cli.evaluate import add_eval_parser, cmd_eval
from app.cli.resume import cmd_resume
from app.cli.train import add_train_parsers, cmd_train
from app.cli.grpo import add_grpo_parser, cmd_grpo
from app.cli.models import add_models_parser, cmd_models
from app.cli.output import ensure_standard_streams, guarded_output, silence
from app.engine.errors import ConfigError, EngineError, MissingModuleError
from app.engine.training import events


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", required=True, help="GGUF model file")
    p.add_argument("--adapter", "-a", help="GGUF LoRA adapter file")
    p.add_argument("--scale", "-s", type=float, default=1.0, help="adapter user scale (default 1.0)")


def _whole(lo: int, hi: int):
    """An argparse type: a whole number from `lo` to `hi` (a job id of 23 digits, say, is an
    error of the command line, not an OverflowError of SQLite's 64-bit integers)."""
    def whole(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # not a number, or more digits than int() reads
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a whole number") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{text[:40]} is not from {lo} to {hi}")
        return value
    return whole


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds from 0 to a week."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number of seconds") from None
    if not 0 <= value <= 7 * 86400:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"{text[:40]} is not from 0 to 604800 seconds")
    return value


def _utf8(text: str) -> str:
    """An argparse type: text to tokenize or generate from, without a byte that is not UTF-8
    (which argv holds as a surrogate escape that no tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("the text holds a byte that is not UTF-8 (check the "
                                         "terminal's encoding)") from None
    return text


JOB_ID = _whole(1, 2**63 - 1)      # SQLite's rowids
PRIORITY = _whole(-10**9, 10**9)


def _queue_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--queue", metavar="PATH",
                   help="queue database (default: $WORKBENCH_QUEUE, else the user data dir); "
                        "its clusters are in clusters.json beside it")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="workbench",
        description="Fine-tune GGUF language models. Without a command, opens the window.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("info", help="show a GGUF model's card")
    p.add_argument("model", help="GGUF model file")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank for the memory estimate")
    p.add_argument("--context", type=int, default=512, help="context for the memory estimate")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("generate", help="generate text (streams to stdout)")
    _model_options(p)
    p.add_argument("--prompt", "-p", required=True, type=_utf8)
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user turn with the model's chat template")
    p.add_argument("--max-tokens", "-n", type=int, default=64)
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)

    p = sub.add_parser("logits", help="write the logits of a token sequence to a .npy file")
    _model_options(p)
    p.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--out", "-o", required=True, help="output .npy file (float32, T x V)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")

    p = sub.add_parser("tokenize", help="print the token ids of a text")
    p.add_argument("--model", "-m", required=True, help="GGUF model or vocab file")
    p.add_argument("--text", required=True, type=_utf8)
    p.add_argument("--no-special", action="store_true", help="do not add BOS/EOS")
    p.add_argument("--parse-special", action="store_true", help="parse <special> token texts")
    p = sub.add_parser("lint", help="check a JSONL dataset against a model's tokenizer",
                       description="Check a JSONL dataset against a model's tokenizer. Exit "
                                   "status: 0 when rows are accepted (rejected ones are listed; "
                                   "training skips them), 1 when nothing would train (no row "
                                   "accepted, or all dropped or weighted 0), 2 on an error.")
    p.add_argument("data", help="JSONL dataset")
    p.add_argument("--model", "-m", required=True, help="GGUF model (or vocab) file")
    p.add_argument("--ctx", type=int, default=None,
                   help="context in tokens (default 512, capped at the model's)")
    p.add_argument("--format", default="auto",
                   choices=["auto", "text", "completion", "chat", "alpaca", "sharegpt",
                            "preference", "kto"])
    p.add_argument("--overflow", default="truncate", choices=["truncate", "split", "drop"],
                   help="rows longer than the context (default truncate)")
    p.add_argument("--weights", help="reward weights file (numbers, or JSONL with ids)")
    p.add_argument("--normalize", default="none", choices=["none", "mean-std", "min-max", "clip"])
    p.add_argument("--clip", type=float, nargs=2, metavar=("LO", "HI"), help="range for --normalize clip")
    p.add_argument("--allow-negative", action="store_true", help="allow negative weights")
    p.add_argument("--completion-as-chat", action="store_true",
                   help="render prompt/completion rows with the chat template")
    p.add_argument("--parse-special", action="store_true",
                   help="in text/completion rows, turn special-token texts into their tokens")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")

    add_train_parsers(sub)
    add_grpo_parser(sub)
    add_eval_parser(sub)
    add_models_parser(sub)

    p = sub.add_parser("new-model", help="write a freshly initialised small model (train from scratch)")
    p.add_argument("--tokenizer", required=True, help="GGUF file whose tokenizer is copied")
    p.add_argument("--out", "-o", required=True, help="output GGUF file")
    p.add_argument("--arch", default="llama", help="architecture (default llama)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=0, help="default: same as --heads")
    p.add_argument("--ffn", type=int, default=688, help="FFN width (per expert for MoE)")
    p.add_argument("--experts", type=int, default=0)
    p.add_argument("--experts-used", type=int, default=0)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--tied", action="store_true", help="tie the output head to the embedding")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output file (never the tokenizer's model)")

    p = sub.add_parser("queue", help="the training job queue: add, list, cancel, pause, resume, "
                                     "retry, reorder, worker")
    qsub = p.add_subparsers(dest="queue_command", required=True, metavar="ACTION")
    qp = {name: qsub.add_parser(name, help=text) for name, text in (
        ("add", "queue a run directory (it must hold config.json)"),
        ("list", "list the jobs with their progress"),
        ("cancel", "cancel a job (a running job stops after its current step)"),
        ("pause", "pause a job (a running job saves a checkpoint and stops after its step)"),
        ("resume", "resume a paused job (it continues from its last checkpoint)"),
        ("retry", "queue a failed or cancelled job again (from its last checkpoint)"),
        ("reorder", "move a queued or paused job to POSITION (1 = next)"),
        ("logs", "the output of a running job: its Ray job's logs, or the local worker's log"),
        ("worker", "run queued jobs in this process, one after another"))}
    for q in qp.values():
        _queue_option(q)
    qp["add"].add_argument("run_dir", help="run directory holding config.json")
    qp["add"].add_argument("--on", metavar="CLUSTER", default="local",
                           help="run it on this cluster (see: workbench cluster list)")
    qp["add"].add_argument("--priority", type=PRIORITY, default=0,
                           help="higher goes ahead of queued jobs with a lower priority")
    qp["list"].add_argument("--state", action="append", help="only jobs in this state (repeatable)")
    qp["list"].add_argument("--json", action="store_true", help="print JSON")
    for name in ("cancel", "pause", "resume", "retry", "reorder", "logs"):
        qp[name].add_argument("id", type=JOB_ID, help="job id (see: workbench queue list)")
    qp["reorder"].add_argument("position", type=_whole(1, 10**9),
                               help="new place among queued jobs (1 = next)")
    qp["worker"].add_argument("--once", action="store_true",
                              help="exit when no job is queued instead of waiting for more")
    qp["worker"].add_argument("--nice", type=_whole(0, 19), default=0, metavar="N",
                              help="lower this worker's CPU priority by N (POSIX nice; the "
                                   "window starts its worker with 10)")
    qp["worker"].add_argument("--pending-timeout", type=_seconds, default=None, metavar="S",
                              help="fail a cluster job that pends longer than S seconds on a "
                                   "cluster without the GPUs it asks (default 60)")
    qp["worker"].add_argument("--stop-grace", type=_seconds, default=None, metavar="S",
                              help="how long a cluster job that is cancelled or paused may take "
                                   "to save its checkpoint and exit (default 30)")
    r = qsub.add_parser("run-remote", help="run one attempt of a run here, without a queue (the "
                                           "entrypoint a cluster runs)")
    r.add_argument("run_dir", help="run directory holding config.json, as this machine sees it")
    r.add_argument("--path-map", default="", metavar="LOCAL=CLUSTER,...",
                   help="read the files its config names (model, data) through this map")

    p = sub.add_parser("cluster", help="the Ray clusters runs can be sent to: add, list, test, "
                                       "remove")
    csub = p.add_subparsers(dest="cluster_command", required=True, metavar="ACTION")
    c = csub.add_parser("add", help="add (or replace) a cluster: its Ray dashboard URL")
    c.add_argument("name")
    c.add_argument("url", help="the Ray dashboard's address, e.g. http://head-node:8265")
    c.add_argument("--token-stdin", action="store_true",
                   help="read its token (RAY_AUTH_TOKEN of the head) from the first line of "
                        "stdin; kept in the OS keyring")
    c.add_argument("--path-map", default="", metavar="LOCAL=CLUSTER,...",
                   help="where the cluster sees this machine's run folders")
    c.add_argument("--python", default="python",
                   help="the interpreter with the workbench installed on the cluster's nodes")
    c.add_argument("--cpus", type=float, default=1.0, help="CPUs each run asks (default 1)")
    c.add_argument("--gpus", type=float, default=0.0, help="GPUs each run asks (default 0)")
    csub.add_parser("list", help="the clusters and their path maps")
    for name, text in (("test", "check the connection and the token, then run a small job "
                                "there that imports the workbench (its version) and reads "
                                "and writes through the path map"),
                       ("remove", "forget a cluster and its token")):
        csub.add_parser(name, help=text).add_argument("name")
    for c in csub.choices.values():
        _queue_option(c)

    p = sub.add_parser("runs", help="inspect run directories: list, show")
    rsub = p.add_subparsers(dest="runs_command", required=True, metavar="ACTION")
    r = rsub.add_parser("list", help="every run the workbench created, or the runs under a folder")
    r.add_argument("dir", nargs="?", help="folder of runs (default: every run the workbench "
                                          "created, wherever its folder is)")
    r.add_argument("--json", action="store_true", help="print JSON")
    r = rsub.add_parser("show", help="a run's config, status, final and best metrics")
    r.add_argument("run_dir")
    r.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("export", help="export a run (or an adapter) as a GGUF LoRA adapter, a "
                                      "merged GGUF, a PEFT adapter or an Ollama Modelfile; verified")
    p.add_argument("run_dir", nargs="?", help="run directory (its best checkpoint: --checkpoint)")
    p.add_argument("--to", required=True, choices=("gguf-lora", "merged", "peft", "ollama"))
    p.add_argument("--out", "-o", help="output file (gguf-lora, merged) or folder (peft, ollama); "
                                       "default: RUN_DIR/exports/")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output (never the export's own inputs)")
    p.add_argument("--type", choices=("f32", "f16", "bf16", "q8_0"),
                   help="stored type: of adapter tensors (default f32; PEFT: f32 or f16), of a "
                        "merged model's changed tensors (default f16)")
    p.add_argument("--scale", "-s", type=float, default=1.0,
                   help="adapter user scale, folded into the export (default 1.0)")
    p.add_argument("--adapter", "-a", help="export this adapter (GGUF LoRA file or PEFT folder) "
                                           "instead of a run; needs --model")
    p.add_argument("--model", "-m", help="base GGUF model (default: the run's)")
    p.add_argument("--checkpoint", default="best", metavar="best|final|STEP",
                   help="which checkpoint of the run: the best by validation loss (GRPO: "
                        "reward), the final (newest) one, or a step (default: best)")
    p.add_argument("--no-llamacpp", action="store_true",
                   help="skip the llama.cpp comparison even if llama-cpp-python is installed")
    p.add_argument("--json", action="store_true", help="print the verification report as JSON")
    return parser


def cmd_new_model(args) -> int:
    from app.engine.model.new_model import NewModelSpec, create_model
    from app.engine.runs.destinations import check_destination, make_parent

    spec = NewModelSpec(arch=args.arch, n_layer=args.layers, n_embd=args.width,
                        n_head=args.heads, n_head_kv=args.kv_heads, n_ff=args.ffn,
                        n_expert=args.experts, n_expert_used=args.experts_used,
                        context_length=args.context, tied_output=args.tied, seed=args.seed)
    out = check_destination(args.out, overwrite=args.overwrite, what="the new model",
                            inputs=[("the model whose tokenizer it copies", args.tokenizer)])
    make_parent(out)
    create_model(out, spec, args.tokenizer)
    print(f"wrote {out}")
    return 0


def cmd_info(args) -> int:
    from app.engine.model.card import describe_model

    card = describe_model(args.model, rank=args.rank, context=args.context)
    if args.json:
        print(json.dumps(card.to_dict(), indent=2))
        return 0
    width = max(len(label) for label, _ in card.rows())
    for label, value in card.rows():
        print(f"{label:<{width}}  {value}")
    return 0


def _load(args):
    from app.engine import load_adapter, load_model

    model = load_model(args.model)
    adapter = load_adapter(args.adapter) if args.adapter else None
    return model, adapter


def cmd_generate(args) -> int:
    model, adapter = _load(args)
    tok = model.tokenizer
    from app.engine.text.chat_template import chat_prompt_ids, generation_prompt_ids

    prompt_ids = (chat_prompt_ids(tok, args.prompt) if args.chat
                  else generation_prompt_ids(tok, args.prompt))
    new_ids: list[int] = []
    printed = ""
    for token in model.generate(prompt_ids, args.max_tokens, args.temperature, args.top_p,
                                args.seed, adapter, args.scale):
        new_ids.append(token)
        text = tok.decode(new_ids)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    sys.stdout.write(tok.decode(new_ids)[len(printed):] + "\n")
    return 0


def cmd_logits(args) -> int:
    try:
        tokens = [int(t) for t in args.tokens.replace(" ", "").split(",") if t]
    except ValueError:
        raise ConfigError(f"--tokens must be comma-separated integers, got {args.tokens!r}.") from None
    from app.engine.runs.destinations import check_destination, make_parent
    from app.engine.runtime.files import atomic_write_bytes

    out = check_destination(args.out, overwrite=args.overwrite, what="the logits",
                            inputs=[("the model", args.model), ("the adapter", args.adapter)])
    model, adapter = _load(args)
    logits = model.logits(tokens, adapter=adapter, adapter_scale=args.scale)
    npy = io.BytesIO()
    np.save(npy, logits)          # at the path given (np.save would add .npy to other names)
    make_parent(out)
    atomic_write_bytes(out, npy.getvalue())
    print(f"wrote {out}: float32 {logits.shape[0]} x {logits.shape[1]}")
    return 0


def cmd_tokenize(args) -> int:
    from app.engine import load_tokenizer

    tok = load_tokenizer(args.model)
    ids = tok.encode(args.text, add_special=not args.no_special, parse_special=args.parse_special)
    print(",".join(map(str, ids)))
    return 0


def cmd_lint(args) -> int:
    from app.engine.data.dataset import DataConfig
    from app.engine.data.lint import lint_file

    sft_format = "auto" if args.format in ("preference", "kto") else args.format
    config = DataConfig(format=sft_format, overflow=args.overflow, weights_path=args.weights,
                        normalize=args.normalize, clip_range=tuple(args.clip) if args.clip else None,
                        allow_negative_weights=args.allow_negative,
                        completion_as_chat=args.completion_as_chat,
                        parse_special=args.parse_special)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")   # dataset text on a console that lacks its characters
    if args.format in ("auto", "preference", "kto"):   # chosen/rejected pairs, KTO rows
        from app.engine.data.preferences import lint_preference_file

        found = lint_preference_file(args.data, args.model, config, args.ctx, args.format)
        if found is not None:
            print(json.dumps(found, ensure_ascii=False) if args.json else found["text"])
            return 0 if found["trains"] else 1
    report = lint_file(args.data, args.model, config, context=args.ctx)
    print(json.dumps(report.to_dict(), ensure_ascii=False) if args.json else report.to_text())
    return 0 if report.trains else 1  # like a linter that found problems: nothing to train on


def _fmt_seconds(s) -> str:
    if not isinstance(s, (int, float)) or not 0 <= s < 1e12:  # NaN, inf, any nonsense
        return "?"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _fmt_progress(status: dict) -> str:
    parts = []
    if status.get("step") is not None:
        total = status.get("total_steps")
        parts.append(f"step {status['step']}" + (f"/{total}" if total else ""))
    if isinstance(status.get("reward_mean"), (int, float)):
        parts.append(f"reward {status['reward_mean']:.3f}")
    if isinstance(status.get("loss"), (int, float)):
        parts.append(f"loss {status['loss']:.4f}")
    if status.get("eta_s") is not None and status.get("state") == "running":
        parts.append(f"eta {_fmt_seconds(status['eta_s'])}")
    return ", ".join(parts)


def _run_status(run_dir) -> dict:
    from app.engine.runs.rundir import RunDir

    try:
        return RunDir(run_dir).status()
    except EngineError as e:
        return {"problem": e.message}


def cmd_queue(args) -> int:
    from app.engine.runs.queue import JobQueue

    action = args.queue_command
    if action == "run-remote":
        from app.engine.runs.clusters import PathMap
        from app.engine.runs.remote import run_remote

        return run_remote(args.run_dir, path_map=PathMap.parse(args.path_map))
    queue = JobQueue(args.queue)
    if action == "add":
        job_id = queue.add(args.run_dir, priority=args.priority, executor=args.on)
        job = queue.get(job_id)
        where = "" if job.is_local else f" on {job.executor}"
        print(f"queued job {job_id}: {job.run_dir}{where}")
        return 0
    if action == "list":
        from app.engine.runs.worker import job_state

        jobs = queue.list(args.state)
        if args.json:
            print(json.dumps([{**j.to_dict(), "status": _run_status(j.run_dir)} for j in jobs],
                             indent=2))
            return 0
        if not jobs:
            print(f"no jobs in {queue.path}")
            return 0
        print(f"{'ID':>4}  {'STATE':<22}  {'ON':<12}  {'TRY':>3}  {'RUN':<30}  PROGRESS")
        for j in jobs:
            status = _run_status(j.run_dir)
            # a cluster job the cluster has not accepted yet is "submitting", not "running"
            state = job_state(j, status) + (f" ({j.requested_action} requested)"
                                            if j.requested_action != "none" else "")
            info = (f"{j.error_kind}: {j.error_message}" if j.state == "failed"
                    else status.get("problem") or _fmt_progress(status))
            name = j.run_dir if len(j.run_dir) <= 30 else "..." + j.run_dir[-27:]
            print(f"{j.id:>4}  {state:<22}  {j.executor:<12}  {j.attempt:>3}  {name:<30}  "
                  f"{info}")
        return 0
    if action == "worker":
        import logging
        import threading

        from app.engine.runs.worker import (install_stop_signals, lower_priority, restore_signals,
                                            run_worker)

        lower_priority(args.nice)
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(message)s")
        stop = threading.Event()
        previous = install_stop_signals(stop)
        try:
            options = {name: value for name, value in (
                ("pending_timeout_s", args.pending_timeout), ("stop_grace_s", args.stop_grace))
                if value is not None}
            n = run_worker(queue, once=args.once, stop_event=stop, **options)
        finally:
            restore_signals(previous)
        print(f"worker stopped after {n} job(s)", file=sys.stderr)
        return 0
    if action == "logs":
        from app.engine.runs.executors import executor_for

        job = queue.get(args.id)
        if job.handle is None:
            raise ConfigError(f"Job {job.id} is {job.state}: no attempt of it runs now.",
                              f"Its run's own log: {job.rundir().log_path}")
        print(executor_for(job, queue).logs(job.handle), end="")
        return 0
    if action == "reorder":
        job = queue.reorder(args.id, args.position)
    else:
        job = getattr(queue, action)(args.id)
    note = f", {job.requested_action} requested" if job.requested_action != "none" else ""
    print(f"job {job.id}: {job.state}{note}")
    return 0


def cmd_cluster(args) -> int:
    from app.engine.runs.clusters import Cluster, PathMap
    from app.engine.runs.executors import cluster_test
    from app.engine.runs.queue import JobQueue

    store = JobQueue(args.queue).clusters()
    action = args.cluster_command
    if action == "add":
        token = sys.stdin.readline().strip() if args.token_stdin else None
        cluster = Cluster(args.name, args.url, PathMap.parse(args.path_map), python=args.python,
                          num_cpus=args.cpus, num_gpus=args.gpus)
        warning = store.save(cluster, token)
        print(f"cluster {cluster.name}: {cluster.url}" + (" (token saved)" if token else ""))
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    elif action == "list":
        clusters = store.list()
        if not clusters:
            print("no clusters yet (add one: workbench cluster add NAME URL --token-stdin)")
        for c in clusters:
            try:
                token = "token set" if store.token(c.name) else "no token"
            except ConfigError:
                token = "token unusable (cluster test says why)"
            print(f"{c.name}  {c.url}  {c.num_cpus:g} CPU, {c.num_gpus:g} GPU per run  "
                  f"python {c.python}  {token}  paths: {c.path_map or '(none)'}")
    elif action == "test":
        cluster, token = store.get(args.name), store.token(args.name)
        for _, answer in cluster_test(cluster, token):   # what Settings' Test connection says
            print(f"{args.name}: {answer}", flush=True)
    else:
        store.remove(args.name)
        print(f"removed cluster {args.name}")
    return 0


def _run_row(r) -> list[str]:
    """A `runs list` row of a RunEntry (app.engine.runs.rundir)."""
    name = lambda path: os.path.basename(path) if path else "-"
    steps = "-" if r.step is None else f"{r.step}" + (f"/{r.total_steps}" if r.total_steps else "")
    best = "-" if not r.best else (f"{r.best['metric'].replace('_', ' ')} "
                                   f"{r.best['value']:.4g} @{r.best['step']}")
    return [r.name, r.kind, name(r.model), name(r.dataset),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created)) if r.created else "-",
            "-" if r.duration_s is None else _fmt_seconds(r.duration_s), steps, best,
            r.executor + (f" #{r.attempt}" if r.attempt else ""), r.state]


def _as_printed(text: str) -> str:
    """`text` as stdout shows it: what it cannot encode (a run folder's byte that is not UTF-8)
    escaped, as `_escape_unencodable_output` makes the stream do."""
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    return text.encode(encoding, "backslashreplace").decode(encoding)


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    """Columns padded by the width each cell has as printed (an escaped name is wider)."""
    header, rows = [_as_printed(c) for c in header], [[_as_printed(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def cmd_runs(args) -> int:
    from app.engine.runs.rundir import (RunDir, best_checkpoint, best_evaluation, list_runs,
                                        registered_runs, run_entry)

    if args.runs_command == "list":
        rows = ([run_entry(r.path) for r in list_runs(args.dir)] if args.dir
                else registered_runs())
        if args.json:
            print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2, default=str))
        elif not rows:
            print("no runs found")
        else:
            _print_table(["NAME", "KIND", "MODEL", "DATASET", "CREATED", "DURATION", "STEPS",
                          "BEST", "ON", "STATUS"], [_run_row(r) for r in rows])
        return 0
    run = RunDir(args.run_dir)
    run.config()  # not a run directory: a clear error
    summary = run.summary()
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    print(f"run      {summary['run_dir']}")
    cfg = summary["config"] or {}
    simple = {k: v for k, v in cfg.items() if isinstance(v, (str, int, float, bool)) or v is None}
    if simple:
        print("config   " + ", ".join(f"{k}={v}" for k, v in simple.items()))
    st = summary["status"]
    print(f"state    {st.get('state', 'new')}" + (f"  ({_fmt_progress(st)})" if _fmt_progress(st)
                                                  else ""))
    best = best_evaluation(run.metrics())
    if best:
        kept = best_checkpoint(run.path)
        print(f"best     {best['metric'].replace('_', ' ')} {best['value']:.5g} at step "
              f"{best['step']}" + (f" (checkpoint {kept[1].name})" if kept else ""))
    if st.get("error"):
        print(f"error    {st['error'].get('kind')}: {st['error'].get('message')}")
        if st["error"].get("hint"):
            print(f"hint     {st['error']['hint']}")
    skip = {events.TYPE, events.TIME}
    for label, by_kind in (("final", summary["final"]), ("best", summary["best"])):
        for kind, ev in by_kind.items():
            if kind in (events.STEP, events.EVAL):
                values = ", ".join(f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in ev.items()
                                   if k not in skip and isinstance(v, (int, float, str)))
                print(f"{label + ' ' + kind:<13}{values}")
    print(f"events   {summary['events']} in metrics.jsonl")
    for problem in summary["problems"]:
        print(f"problem  {problem}")
    return 0


def _export_step(run_dir: str, checkpoint: str) -> int | None:
    """The checkpoint step `workbench export --checkpoint` names, the best one said on stderr
    (None: the run's newest intact checkpoint, else its adapter.gguf)."""
    from app.engine.runs.rundir import RunDir, best_checkpoint

    if checkpoint.isdigit():
        return int(checkpoint)
    if checkpoint not in ("best", "final"):
        raise ConfigError(f"--checkpoint {checkpoint!r} is neither best, final nor a step number.")
    best = best_checkpoint(run_dir) if checkpoint == "best" else None
    if best:
        step, _, metric = best
        what = "reward" if RunDir(run_dir).config().get("kind") == "grpo" else "validation loss"
        print(f"exporting the best checkpoint, step {step} ({what} {metric:.4g}); "
              "--checkpoint final|STEP to choose", file=sys.stderr)
        return step
    return None


def cmd_export(args) -> int:
    from app.engine.export.exporter import export, source_from_adapter, source_from_run

    if args.run_dir and args.adapter:
        raise ConfigError("Give a run directory or --adapter, not both.")
    if args.run_dir:
        step = _export_step(args.run_dir, args.checkpoint)
        source = source_from_run(args.run_dir, step=step, model_path=args.model)
        if step is None and source.checkpoint:     # after a damaged newer one: a warning too
            print(f"exporting the final checkpoint, step {os.path.basename(source.checkpoint)[5:]}"
                  + (" (no evaluation chose a best one)" if args.checkpoint == "best" else ""),
                  file=sys.stderr)
    elif args.adapter:
        if not args.model:
            raise ConfigError("--adapter needs the base model (--model).")
        source = source_from_adapter(args.adapter, args.model)
    else:
        raise ConfigError("Nothing to export.", "Give a run directory, or --adapter and --model.")
    report = export(source, args.to, args.out, adapter_type=args.type, scale=args.scale,
                    llamacpp=False if args.no_llamacpp else None, overwrite=args.overwrite,
                    notify=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_text())
    if not report.ok:
        print(f"error: the export failed verification, so it was moved aside to {report.path} "
              f"instead of {report.moved_from}; do not use it.", file=sys.stderr)
        return 3
    return 0


COMMANDS = {"lint": cmd_lint, "info": cmd_info, "generate": cmd_generate, "logits": cmd_logits,
            "tokenize": cmd_tokenize, "new-model": cmd_new_model,
            "queue": cmd_queue, "cluster": cmd_cluster, "runs": cmd_runs, "train": cmd_train,
            "resume": cmd_resume, "export": cmd_export, "grpo": cmd_grpo, "eval": cmd_eval,
            "models": cmd_models}


def _print_error(e: EngineError) -> int:
    """`error:` and `hint:` on stderr; the exit status of an EngineError (2)."""
    print(f"error: {e.message}", file=sys.stderr)
    if e.hint:
        print(f"hint: {e.hint}", file=sys.stderr)
    return 2


def _escape_unencodable_output() -> None:
    """A path with a byte that is not UTF-8 (os.fsdecode's surrogate escapes), or text the
    console cannot show, is printed escaped, never a UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


def run_cli(argv: list[str]) -> int:
    """Run the command of `argv`; its exit status. Printing never fails it (app.cli.output): a
    closed stdout or stderr is the null device, stdout that cannot be written is an error
    (exit 2) and stderr that cannot be written is dropped."""
    ensure_standard_streams()
    _escape_unencodable_output()
    with guarded_output():
        return _run_command(argv)


def _run_command(argv: list[str]) -> int:
    code = 0
    try:
        args = build_parser().parse_args(argv)   # --help's text is output too
        if args.command in ("train", "grpo") and args.on and args.queue is None:
            args.queue = ""  # `train --on CLUSTER` queues the run
        code = COMMANDS[args.command](args)
        sys.stdout.flush()  # a closed pipe shows here, not in Python's flush at exit
        return code
    except BrokenPipeError:  # the reader went away (`queue list | head`): it read what it wanted
        silence(sys.stdout)
        return code  # the command's own status if it ended before the flush, else 0
    except EngineError as e:
        return _print_error(e)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if isinstance(e, ModuleNotFoundError) and MissingModuleError.of(e):
            return _print_error(MissingModuleError.of(e))  # an installation, not a bug
        traceback.print_exc()
        print("error: this is a bug in the workbench; please report it with the traceback above.",
              file=sys.stderr)
        return 1
