"""Perplexity you can compare with llama.cpp's `llama-perplexity`: the computation lives in
app.engine.evaluation.perplexity (the evaluation layer, which `workbench eval --task` and the
queue's evaluations use too); this module re-exports it for the export's checks and adds the
Export view's side-by-side comparison."""

from __future__ import annotations

import os

from app.engine.evaluation.perplexity import (  # noqa: F401  (re-exported)
    Perplexity, chunks, mean_nll, perplexity, perplexity_of_tokens, scored_nll, token_nlls)


def compare_perplexity(source, text_path: str | os.PathLike, n_ctx: int,
                       merged_path: str | os.PathLike | None = None) -> dict[str, Perplexity]:
    """Perplexity of the base model, base + adapter (an ExportSource's) and a merged export on
    one text, chunked as llama-perplexity: what the Export view shows side by side."""
    from app.engine.model.transformer import load_model

    model = load_model(source.model_path)
    out = {"base": perplexity(model, text_path, n_ctx)}
    if source.adapter is not None and not source.full:
        out["base + adapter"] = perplexity(model, text_path, n_ctx, source.adapter)
    if merged_path:
        out["merged"] = perplexity(load_model(merged_path), text_path, n_ctx)
    return out
