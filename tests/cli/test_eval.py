"""`workbench eval`: perplexity with llama-perplexity's chunking, against a reference computed
here from the model's logits."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from app.cli.main import run_cli
from app.engine.errors import ConfigError
from app.engine.export.evaluate import chunks
from app.engine.model.lora import load_adapter
from app.engine.model.transformer import load_model
from tests.conftest import GOLDEN

TEXT = " ".join(f"The {w} sat on the {v} mat number {i}." for i, (w, v) in
                enumerate(zip(["cat", "dog", "bird", "fox"] * 20, ["red", "blue", "old"] * 27)))


def _reference(model, tokens, n_ctx, adapter=None):
    """llama-perplexity: n_tokens // n_ctx chunks, BOS in front of each, second half scored."""
    total, count = 0.0, 0
    for c in range(len(tokens) // n_ctx):
        chunk = list(tokens[c * n_ctx:(c + 1) * n_ctx])
        if model.tokenizer.add_bos:
            chunk[0] = model.tokenizer.bos_id
        logits = model.logits(chunk, adapter=adapter).astype(np.float64)
        for pos in range(n_ctx // 2, n_ctx - 1):
            row = logits[pos]
            lse = row.max() + math.log(np.exp(row - row.max()).sum())
            total += lse - row[chunk[pos + 1]]
            count += 1
    return math.exp(total / count), count


@pytest.mark.parametrize("name,adapter", [("llama", False), ("gemma3", True)])
def test_eval_matches_llama_perplexity_chunking(tmp_path, capsys, name, adapter):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    model = load_model(GOLDEN / f"{name}-f32.gguf")
    lora = load_adapter(GOLDEN / f"{name}-lora.gguf") if adapter else None
    tokens = model.tokenizer.encode(TEXT, add_special=True)
    n_ctx = 32
    assert len(tokens) >= 3 * n_ctx
    want, count = _reference(model, tokens, n_ctx, lora)
    args = ["eval", "-m", str(GOLDEN / f"{name}-f32.gguf"), "-f", str(text), "--ctx", str(n_ctx)]
    args += ["-a", str(GOLDEN / f"{name}-lora.gguf")] if adapter else []
    assert run_cli(args + ["--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["ppl"] == pytest.approx(want, rel=1e-6)
    assert got["n_scored"] == count == (len(tokens) // n_ctx) * (n_ctx - 1 - n_ctx // 2)
    assert got["n_chunks"] == len(tokens) // n_ctx and len(got["chunk_ppl"]) == got["n_chunks"]
    assert run_cli(args) == 0
    assert capsys.readouterr().out.startswith(f"PPL = {want:.4f}")


def test_eval_chunks_and_short_texts(tmp_path, capsys):
    parts = chunks(list(range(10, 75)), 16, bos_id=1)
    assert len(parts) == 4 and all(p[0] == 1 and len(p) == 16 for p in parts)
    assert parts[1][1:] == list(range(27, 42))
    assert chunks(list(range(40)), 16, None)[1][0] == 16      # no BOS: the text's own token
    with pytest.raises(ConfigError, match="at least 64"):
        chunks(list(range(63)), 32, 1)
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    assert run_cli(["eval", "-m", str(GOLDEN / "llama-f32.gguf"), "-f", str(short)]) == 2
    assert "needs at least 1024" in capsys.readouterr().err
