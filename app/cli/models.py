"""`workbench models`: find, list and get GGUF models from the Hugging Face Hub.

    workbench models search QUERY [--author A] [--sort downloads|likes] [--json]
    workbench models files REPO[@REV] [--revision REV] [--fits] [--json]
    workbench models get REPO[:FILE|:QUANT][@REV] [--revision REV] [--to DIR [--link]] [--json]
    workbench models list [--json]

`@REV` (or --revision REV) picks a branch, tag or commit of the repository instead of main
(`owner/name:Q4_K_M@v1.0`); the cache keeps each revision's files apart, as the client does.
`get` prints the local path on stdout and its progress on stderr; `train -m REPO[:QUANT][@REV]`
resolves the same way (`resolve_model`): the cached model when there is one (no network), else
a download. The settings (HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE, HF_TOKEN) are the Hub client's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from app.engine.errors import UnsupportedModelError


def add_models_parser(sub) -> None:
    p = sub.add_parser("models", help="GGUF models from the Hugging Face Hub: search, files, "
                                      "get, list (downloaded and found on this computer)")
    msub = p.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    s = msub.add_parser("search", help="repositories with GGUF files (most downloaded first)")
    s.add_argument("query", nargs="?", default="", help="text in the repository's name")
    s.add_argument("--author", help="only this user's or organisation's repositories")
    s.add_argument("--sort", choices=("downloads", "likes"), default="downloads")
    s.add_argument("--limit", type=int, default=30, help="at most this many (default 30)")
    s.add_argument("--json", action="store_true", help="print one JSON list")
    f = msub.add_parser("files", help="a repository's GGUF models: sizes, quant types "
                                      "(split files as one model)")
    f.add_argument("repo", metavar="REPO[@REV]", help="owner/name, owner/name@v1.0")
    _revision_option(f)
    f.add_argument("--fits", action="store_true",
                   help="read each model's header (a ranged request, no weights) and say "
                        "whether its architecture trains here and its LoRA memory estimate")
    _estimate_options(f)
    f.add_argument("--json", action="store_true", help="print one JSON list")
    g = msub.add_parser("get", help="download a model into the Hugging Face cache (resumes an "
                                    "interrupted download); prints its local path")
    g.add_argument("spec", metavar="REPO[:FILE|:QUANT][@REV]",
                   help="owner/name, owner/name:Q4_K_M or owner/name:file.gguf; @REV at the "
                        "end for a branch, tag or commit other than main")
    _revision_option(g)
    g.add_argument("--to", metavar="DIR", help="also copy the file(s) into DIR")
    g.add_argument("--link", action="store_true", help="with --to: link instead of copying")
    g.add_argument("--any-architecture", action="store_true",
                   help="download even when the header says the workbench cannot train it")
    _estimate_options(g)
    g.add_argument("--json", action="store_true", help="print the result as one JSON object")
    lst = msub.add_parser("list", help="models downloaded from the Hub and found on this computer "
                                       "(llama.cpp, LM Studio, Ollama): no network")
    lst.add_argument("--json", action="store_true", help="print one JSON list")


def _revision_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--revision", metavar="REV",
                   help="a branch, tag or commit of the repository (default main; the same "
                        "as @REV at the end of the name)")


def _estimate_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of the estimate (default 16)")
    p.add_argument("--context", type=int, default=512,
                   help="tokens per window of the estimate (default 512)")


def _size(n: int) -> str:
    from app.engine.model.card import human_bytes

    return human_bytes(n)


def cmd_models(args) -> int:
    return {"search": _search, "files": _files, "get": _get, "list": _list}[
        args.models_command](args)


def _search(args) -> int:
    from app.engine.hub import client

    hits = client.search(args.query, args.author, args.sort, max(1, args.limit))
    if args.json:
        print(json.dumps([h.to_dict() for h in hits], indent=2))
        return 0
    if not hits:
        print("no GGUF repository matches", file=sys.stderr)
        return 0
    width = max(len(h.repo_id) for h in hits)
    print(f"{'REPOSITORY':<{width}}  {'DOWNLOADS':>10}  {'LIKES':>6}  UPDATED")
    for h in hits:
        gated = "  (gated)" if h.gated else ""
        print(f"{h.repo_id:<{width}}  {h.downloads:>10,}  {h.likes:>6,}  {h.updated}{gated}")
    return 0


def _files(args) -> int:
    from app.engine.hub import client
    from app.engine.hub.header import quant_shown
    from app.engine.hub.names import parse_spec

    spec = parse_spec(args.repo, args.revision)
    repo = spec.repo_id
    models = client.list_models(repo, spec.revision)
    fits = {m.name: _fit_or_error(client, m, args.rank, args.context) for m in models} \
        if args.fits else {}
    if args.json:
        print(json.dumps([{**m.to_dict(), **({"fit": _fit_dict(fits[m.name])} if fits else {})}
                          for m in models], indent=2))
        return 0
    if not models:
        print(f"{repo} holds no GGUF file", file=sys.stderr)
        return 0
    width = max(len(m.name) for m in models)
    read = {name: fit for name, fit in fits.items() if not isinstance(fit, Exception)}
    quants = {m.name: quant_shown(m.quant, read.get(m.name)) for m in models}
    qwidth = max(10, *(len(q) for q in quants.values()))
    print(f"{'MODEL':<{width}}  {'QUANT':<{qwidth}}  {'SIZE':>9}  "
          + ("FITS" if fits else "FILES"))
    for m in models:
        if not fits:
            last = f"{len(m.files)} parts" if m.is_split else "1"
        else:
            last = read[m.name].note if m.name in read else \
                f"cannot read the header: {fits[m.name].message}"
        print(f"{m.name:<{width}}  {quants[m.name]:<{qwidth}}  {_size(m.size):>9}  {last}")
    at = "" if spec.revision == "main" else f"@{spec.revision}"
    print(f"get one: workbench models get {repo}:QUANT{at}", file=sys.stderr)
    return 0


def _fit_or_error(client, model, rank: int, context: int):
    """What fits of `model`, or the EngineError its header read ended in (one bad file does
    not hide the others); no network, a silent Hub or a refused token still stops the listing."""
    from app.engine.errors import EngineError

    try:
        return client.what_fits(model, rank, context)
    except (client.HubOfflineError, client.HubAuthError):
        raise
    except EngineError as e:
        return e


def _fit_dict(fit) -> dict:
    return {"error": fit.message} if isinstance(fit, Exception) else fit.to_dict()


class _Progress:
    """Progress on stderr: one line rewritten on a terminal, a line per 10% elsewhere."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.last, self.shown_tenth = 0.0, -1

    def __call__(self, done: int, total: int, name: str) -> None:
        now = time.monotonic()
        tenth = done * 10 // total if total else 10
        final = done >= total
        if self.tty and (final or now - self.last >= 0.2):
            self.last = now
            print(f"\r{name}: {done * 100 // max(total, 1):3d}% {_size(done)} of {_size(total)}",
                  end="\n" if final else "", file=self.stream, flush=True)
        elif not self.tty and tenth != self.shown_tenth:
            self.shown_tenth = tenth
            print(f"{name}: {tenth * 10}% of {_size(total)}", file=self.stream, flush=True)


def resolve_model(text: str, rank: int = 16, context: int = 512, check: bool = True,
                  progress=None, to_train: bool = False, revision: str | None = None) -> Path:
    """The local file of a model typed as owner/name[:FILE|:QUANT][@REV] (or at `revision`): the
    cached one of that revision when there is one (no network), else downloaded into the cache (after its header's architecture check
    unless `check` is False). `to_train`: for a split model, its parts merged into one file
    (training reads one; app.engine.hub.merge) and that file's path."""
    from app.engine.hub import client
    from app.engine.hub.names import parse_spec, split_part

    spec = parse_spec(text, revision)
    found = client.find_cached(spec)
    if found is None:
        model = client.choose(client.list_models(spec.repo_id, spec.revision), spec)
        if check:
            fit = client.what_fits(model, rank, context)
            print(f"{model.name}: {fit.note}", file=sys.stderr)
            if not fit.supported:
                raise UnsupportedModelError(
                    f"{model.name} cannot be trained here: {fit.note}.",
                    "Pick another model, or download it anyway with "
                    "`workbench models get --any-architecture`.")
        found = client.download(model, progress=progress or _Progress())
    if to_train and split_part(found.name):        # one file to train: merged once, kept
        from app.engine.hub.merge import merged_dir, trainable_path

        key = f"{spec.repo_id.replace('/', '--')}/{found.parent.name}"
        if not (merged_dir() / key).is_dir():
            print(f"{found.name}: merging the parts into one file to train (once)",
                  file=sys.stderr)
        found = trainable_path(found, key)
    return found


def _get(args) -> int:
    from app.engine.hub import client

    path = resolve_model(args.spec, args.rank, args.context, not args.any_architecture,
                         revision=args.revision)
    out = client.copy_to(path, args.to, link=args.link) if args.to else path
    if args.json:
        print(json.dumps({"path": str(out), "cache_path": str(path)}))
    else:
        print(out)
    return 0


def _list(args) -> int:
    from app.engine.hub.client import hub_settings
    from app.engine.hub.local import discover_models

    found = discover_models()
    if hub_settings().offline:
        print("offline (HF_HUB_OFFLINE): the Hub is not asked; these are on disk", file=sys.stderr)
    if args.json:
        print(json.dumps([{"name": f.name, "source": f.source, "path": f.path, "size": f.size}
                          for f in found], indent=2))
        return 0
    if not found:
        print("no GGUF model found (workbench models get REPO:QUANT downloads one)",
              file=sys.stderr)
        return 0
    width = max(len(f.name) for f in found)
    src = max(len(f.source) for f in found)
    for f in found:
        print(f"{f.name:<{width}}  {f.source:<{src}}  {_size(f.size):>9}  {f.path}")
    return 0


def model_argument(text: str | None, rank: int | None = None,
                   context: int | None = None) -> str | None:
    """`--model` of train and grpo: a path as given; `owner/name[:FILE|:QUANT][@REV]` not an
    existing path resolved through the Hub's cache (`resolve_model`, downloading if needed)."""
    from app.engine.hub.names import looks_like_repo

    if not text or os.path.exists(text) or not looks_like_repo(text):
        return text
    return str(resolve_model(text, rank or 16, context or 512, to_train=True))
