"""Perplexity you can compare with llama.cpp's `llama-perplexity` (tools/perplexity/perplexity.cpp,
`perplexity()`), and the mean NLL the merged export is checked with.

llama-perplexity tokenizes the whole file once (with BOS when the vocabulary adds one, no
special-token parsing), needs at least 2 * n_ctx tokens, and cuts n_chunk = n_tokens // n_ctx
chunks of n_ctx tokens (the remainder is dropped). Each chunk is evaluated from an empty
context with its first token replaced by BOS (when the vocabulary adds one), and only its
second half is scored: the logits at positions n_ctx/2 .. n_ctx-2 predict the tokens
n_ctx/2+1 .. n_ctx-1 (n_ctx - 1 - n_ctx/2 tokens per chunk). PPL = exp(sum NLL / count).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from app.engine.errors import ConfigError
from app.engine.runtime.inputs import open_input

_text_limit = 64 << 20     # bytes of text read for an evaluation


@dataclass
class Perplexity:
    ppl: float
    nll: float                     # mean negative log-likelihood per scored token (nats)
    n_scored: int
    n_chunks: int
    n_ctx: int
    n_tokens: int                  # tokens of the whole text (BOS included)
    chunk_ppl: list[float] = field(default_factory=list)    # running PPL after each chunk

    def to_dict(self) -> dict:
        return {"ppl": self.ppl, "nll": self.nll, "n_scored": self.n_scored,
                "n_chunks": self.n_chunks, "n_ctx": self.n_ctx, "n_tokens": self.n_tokens,
                "chunk_ppl": self.chunk_ppl}

    def to_text(self) -> str:
        return (f"PPL = {self.ppl:.4f} (mean NLL {self.nll:.5f} over {self.n_scored} tokens: "
                f"{self.n_chunks} chunks of {self.n_ctx}, second halves scored; "
                f"{self.n_tokens} tokens in the text)")


def chunks(tokens: Sequence[int], n_ctx: int, bos_id: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: n_tokens // n_ctx windows of n_ctx tokens, each starting with
    BOS (bos_id, when the vocabulary adds one) in place of its first token."""
    if n_ctx < 4:
        raise ConfigError(f"The context must be at least 4 tokens, got {n_ctx}.")
    if len(tokens) < 2 * n_ctx:
        raise ConfigError(f"The text has {len(tokens)} tokens; perplexity with a context of "
                          f"{n_ctx} needs at least {2 * n_ctx} (as llama-perplexity).",
                          "Use a longer text or a smaller --ctx.")
    out = []
    for i in range(len(tokens) // n_ctx):
        chunk = [int(t) for t in tokens[i * n_ctx:(i + 1) * n_ctx]]
        if bos_id is not None:
            chunk[0] = int(bos_id)
        out.append(chunk)
    return out


def token_nlls(logits: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    """-log softmax(logits)[target] per row, in float64 (llama.cpp sums exp in double)."""
    x = np.asarray(logits, np.float64)
    top = x.max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(x - top).sum(axis=1))
    return lse - x[np.arange(len(x)), np.asarray(targets)]


def scored_nll(logits: np.ndarray, chunk: Sequence[int]) -> np.ndarray:
    """The NLLs llama-perplexity scores in one chunk: logits at n_ctx/2 .. n_ctx-2."""
    n_ctx = len(chunk)
    first = n_ctx // 2
    return token_nlls(logits[first:n_ctx - 1], chunk[first + 1:])


def perplexity_of_tokens(logits_fn: Callable[[list[int]], np.ndarray], tokens: Sequence[int],
                         n_ctx: int, bos_id: int | None,
                         progress: Callable[[int, int], None] | None = None) -> Perplexity:
    """Perplexity with llama-perplexity's chunking; logits_fn(chunk) -> (n_ctx, V) logits."""
    parts = chunks(tokens, n_ctx, bos_id)
    total, count, running = 0.0, 0, []
    for i, chunk in enumerate(parts):
        nll = scored_nll(logits_fn(chunk), chunk)
        total += float(nll.sum())
        count += len(nll)
        running.append(math.exp(total / count))
        if progress is not None:
            progress(i + 1, len(parts))
    return Perplexity(math.exp(total / count), total / count, count, len(parts), n_ctx,
                      len(tokens), running)


def perplexity(model, text_path: str | os.PathLike, n_ctx: int, adapter=None,
               scale: float = 1.0,
               progress: Callable[[int, int], None] | None = None) -> Perplexity:
    """`workbench eval`: the model's (with an adapter at `scale`) perplexity on a UTF-8 text
    file, as llama-perplexity -c n_ctx computes it."""
    path = Path(text_path)
    try:   # a regular file (a pipe would block open()), checked by open_input
        with open_input(path, "text", error=ConfigError) as f:
            raw = f.read(_text_limit + 1)
    except OSError as e:
        raise ConfigError(f"Cannot read {path}: {e.strerror or e}.") from None
    if len(raw) > _text_limit:
        raise ConfigError(f"{path} is larger than {_text_limit >> 20} MB.",
                          "Evaluate on a smaller sample.")
    tok = model.tokenizer
    if tok.add_eos:
        raise ConfigError("This vocabulary adds EOS to every text, which llama-perplexity "
                          "refuses too.")
    tokens = tok.encode(raw.decode("utf-8", errors="replace"), add_special=True)
    bos = tok.bos_id if tok.add_bos else None
    return perplexity_of_tokens(lambda chunk: model.logits(chunk, adapter=adapter,
                                                           adapter_scale=scale),
                                tokens, n_ctx, bos, progress)


def mean_nll(logits: np.ndarray, tokens: Sequence[int]) -> float:
    """Mean NLL of tokens[1:] given the logits of tokens[:-1] (every position scored)."""
    return float(token_nlls(logits[:-1], tokens[1:]).mean())
