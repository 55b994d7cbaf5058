"""The `workbench` command line: parse, call the engine's public API, print. No Qt here."""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import numpy as np

from app.engine.errors import ConfigError, EngineError


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", required=True, help="GGUF model file")
    p.add_argument("--adapter", "-a", help="GGUF LoRA adapter file")
    p.add_argument("--scale", "-s", type=float, default=1.0, help="adapter user scale (default 1.0)")


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
    p.add_argument("--prompt", "-p", required=True)
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

    p = sub.add_parser("tokenize", help="print the token ids of a text")
    p.add_argument("--model", "-m", required=True, help="GGUF model or vocab file")
    p.add_argument("--text", required=True)
    p.add_argument("--no-special", action="store_true", help="do not add BOS/EOS")
    p.add_argument("--parse-special", action="store_true", help="parse <special> token texts")
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
    return parser


def cmd_new_model(args) -> int:
    from app.engine.new_model import NewModelSpec, create_model

    spec = NewModelSpec(arch=args.arch, n_layer=args.layers, n_embd=args.width,
                        n_head=args.heads, n_head_kv=args.kv_heads, n_ff=args.ffn,
                        n_expert=args.experts, n_expert_used=args.experts_used,
                        context_length=args.context, tied_output=args.tied, seed=args.seed)
    create_model(args.out, spec, args.tokenizer)
    print(f"wrote {args.out}")
    return 0


def cmd_info(args) -> int:
    from app.engine.model_info import describe_model

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


def _chat_prompt_ids(tok, prompt: str) -> list[int]:
    """Render a one-turn chat with the model's template; add BOS unless the template did."""
    from app.engine.chat_template import render_chat

    bos = tok.token_to_piece(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.token_to_piece(tok.eos_id) if tok.eos_id is not None else ""
    text = render_chat(tok.chat_template, [{"role": "user", "content": prompt}],
                       bos_token=bos, eos_token=eos, add_generation_prompt=True)
    return tok.encode(text, add_special=not (bos and text.startswith(bos)), parse_special=True)


def cmd_generate(args) -> int:
    model, adapter = _load(args)
    tok = model.tokenizer
    prompt_ids = _chat_prompt_ids(tok, args.prompt) if args.chat else tok.encode(args.prompt)
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
    model, adapter = _load(args)
    logits = model.logits(tokens, adapter=adapter, adapter_scale=args.scale)
    np.save(args.out, logits)
    print(f"wrote {args.out}: float32 {logits.shape[0]} x {logits.shape[1]}")
    return 0


def cmd_tokenize(args) -> int:
    from app.engine import load_tokenizer

    tok = load_tokenizer(args.model)
    ids = tok.encode(args.text, add_special=not args.no_special, parse_special=args.parse_special)
    print(",".join(map(str, ids)))
    return 0


COMMANDS = {"info": cmd_info, "generate": cmd_generate, "logits": cmd_logits,
            "tokenize": cmd_tokenize, "new-model": cmd_new_model}


def run_cli(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except EngineError as e:
        print(f"error: {e.message}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception:
        traceback.print_exc()
        print("error: this is a bug in the workbench; please report it with the traceback above.",
              file=sys.stderr)
        return 1
