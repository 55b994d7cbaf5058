"""`workbench eval`: perplexity of a model (with an adapter) on a text file, chunked as
llama.cpp's `llama-perplexity -c N` does (app.engine.export.evaluate), so the two compare."""

from __future__ import annotations

import json
import sys


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="perplexity on a text file, as llama-perplexity computes it")
    p.add_argument("--model", "-m", required=True, help="GGUF model file")
    p.add_argument("--adapter", "-a", help="GGUF LoRA adapter file or PEFT folder")
    p.add_argument("--scale", "-s", type=float, default=1.0, help="adapter user scale (default 1.0)")
    p.add_argument("--file", "-f", required=True, help="UTF-8 text file")
    p.add_argument("--ctx", "-c", type=int, default=512,
                   help="tokens per chunk (llama-perplexity -c; default 512)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def cmd_eval(args) -> int:
    from app.engine.export.evaluate import perplexity
    from app.engine.export.exporter import import_adapter
    from app.engine.model.transformer import load_model

    model = load_model(args.model)
    adapter = import_adapter(args.adapter, model) if args.adapter else None

    def progress(done: int, total: int) -> None:
        if not args.json:
            print(f"\rchunk {done}/{total}", end="" if done < total else "\n", file=sys.stderr,
                  flush=True)

    result = perplexity(model, args.file, args.ctx, adapter, args.scale, progress)
    print(json.dumps(result.to_dict()) if args.json else result.to_text())
    return 0
