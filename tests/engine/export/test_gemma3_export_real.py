"""The real Gemma 3 270M (Q4_K_M): a trained adapter merged at F16 keeps its effect (held-out
mean NLL within 1% of base + adapter), and its Ollama export runs on Ollama's own engine (FROM
the merged model, no ADAPTER, the training template and its stops)."""

from __future__ import annotations

import pytest

from app.engine.data.batches import pack
from app.engine.export.exporter import ExportSource, export, parse_modelfile
from app.engine.model.transformer import load_model
from app.engine.training.config import TrainConfig
from app.engine.training.session import TrainSession

pytestmark = pytest.mark.slow

TEXT = ("Sure! The little robot found a red ball in the garden. Sure! It rolled the ball to its "
        "friend the cat, and the cat rolled it back. Sure! They played until the sun went down.")


@pytest.fixture(scope="module")
def trained(gemma3_270m):
    model = load_model(gemma3_270m)
    session = TrainSession(model, TrainConfig(mode="lora", lora_rank=8, lora_alpha=16,
                                              lora_targets=("attention", "ffn"), lr=3e-3,
                                              max_steps=6))
    ids = model.tokenizer.encode(TEXT)
    for _ in range(6):
        session.step([pack([(ids[:-1], ids[1:])])])
    return model, ExportSource(str(gemma3_270m), session.adapter)


def test_merged_gemma3_keeps_the_adapter(tmp_path, trained):
    model, source = trained
    report = export(source, "merged", tmp_path / "merged.gguf", model=model, llamacpp=False)
    assert report.ok, report.to_text()
    kept = next(c for c in report.checks if c.name == "adapter kept")
    assert kept.data["relative_diff"] < 0.01
    # the adapter's effect on the held-out NLL is far larger than what the merge loses
    assert abs(kept.data["live_nll"] - kept.data["base_nll"]) > 10 * abs(
        kept.data["merged_nll"] - kept.data["live_nll"])
    assert {report.settings["retyped_tensors"][n][1] for n in report.settings["retyped_tensors"]} \
        == {"F16"}


def test_ollama_gemma3_has_no_adapter_a_template_and_stops(tmp_path, trained):
    model, source = trained
    report = export(source, "ollama", tmp_path / "ollama", model=model, llamacpp=False)
    assert report.ok, report.to_text()
    text = (tmp_path / "ollama" / "Modelfile").read_text()
    parsed = parse_modelfile(text)
    assert parsed["adapter"] is None and not (tmp_path / "ollama" / "adapter.gguf").exists()
    assert parsed["from"] == str(tmp_path / "ollama" / "model.gguf")
    assert parsed["template"] and "<|im_start|>" in parsed["template"]   # ChatML: it trained so
    assert {"<|im_end|>", "<end_of_turn>"} <= set(parsed["stops"])
    assert "refuses adapters" in text


LLAMACPP_PPL = r"""
import json, math, sys
import numpy as np
from llama_cpp import Llama
a = json.loads(sys.argv[1])
kw = dict(model_path=a["model"], logits_all=True, n_ctx=a["ctx"], n_batch=a["ctx"],
          n_ubatch=a["ctx"], n_threads=2, n_gpu_layers=0, verbose=False)
if a.get("lora"):
    kw.update(lora_path=a["lora"], lora_scale=1.0)
llm = Llama(**kw)
tokens = llm.tokenize(open(a["text"], "rb").read(), add_bos=True, special=False)
n, total, count = a["ctx"], 0.0, 0
for c in range(len(tokens) // n):           # llama-perplexity's perplexity()
    chunk = list(tokens[c * n:(c + 1) * n])
    chunk[0] = llm.token_bos()
    llm.reset()
    llm.eval(chunk)
    logits = np.asarray(llm.scores[:n], np.float64)
    for pos in range(n // 2, n - 1):
        row = logits[pos]
        total += row.max() + math.log(np.exp(row - row.max()).sum()) - row[chunk[pos + 1]]
        count += 1
print(json.dumps({"ppl": math.exp(total / count), "n_tokens": len(tokens)}))
"""


def _llamacpp_ppl(python, model, text, ctx, lora=None) -> dict:
    import json
    import subprocess

    args = {"model": str(model), "text": str(text), "ctx": ctx, "lora": str(lora) if lora else None}
    out = subprocess.run([python, "-c", LLAMACPP_PPL, json.dumps(args)], capture_output=True,
                         text=True, timeout=900, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_eval_and_the_merge_against_llama_cpp(tmp_path, trained, gemma3_270m):
    """workbench eval within 0.5% of llama.cpp's perplexity (same chunking); the merged model
    as good as the live adapter, in our engine and in llama.cpp.

    llama.cpp's base + --lora and its merged model do not compute alike: the quantized base
    product reads activations rounded to Q8_K, the merged F16 weights F16 activations. On this
    adapter, which moves the perplexity by 40%, that alone moved it by up to 1.3% (measured in
    the engine with and without llama.cpp's rounding: 1.5595 against 1.5447), so each llama.cpp
    run is held to our engine computing the same way, and the merge itself to the live adapter
    computed in float32 (0.06% here; F32 merged weights: 0.002%)."""
    from app.engine.export.evaluate import perplexity
    from app.engine.export.verify import llamacpp_python

    python = llamacpp_python()
    if python is None:
        pytest.skip("llama-cpp-python is not installed (pip install -e '.[verify]')")
    model, source = trained
    text = tmp_path / "text.txt"
    text.write_text(" ".join([TEXT.replace("Sure! ", ""), "The harbour was quiet that night; the "
                              "boats rocked gently and the lamps burned low."] * 12))
    ours = perplexity(model, text, 128)
    theirs = _llamacpp_ppl(python, gemma3_270m, text, 128)
    assert ours.n_tokens == theirs["n_tokens"]
    assert ours.ppl == pytest.approx(theirs["ppl"], rel=0.005)
    adapter = tmp_path / "adapter.gguf"
    assert export(source, "gguf-lora", adapter, model=model, llamacpp=False).ok
    assert export(source, "merged", tmp_path / "merged.gguf", model=model, llamacpp=False).ok
    with_lora = _llamacpp_ppl(python, gemma3_270m, text, 128, adapter)["ppl"]
    merged = _llamacpp_ppl(python, tmp_path / "merged.gguf", text, 128)["ppl"]
    ours_merged = perplexity(load_model(tmp_path / "merged.gguf"), text, 128).ppl
    ours_live = perplexity(model, text, 128, adapter=source.adapter).ppl   # llama.cpp's rounding
    ours_live_float = _float_perplexity(model, text, source.adapter)
    assert ours_merged == pytest.approx(ours_live_float, rel=0.002)      # the merge keeps it
    assert merged == pytest.approx(ours_merged, rel=0.005)
    assert with_lora == pytest.approx(ours_live, rel=0.01)
    assert abs(with_lora - theirs["ppl"]) > 0.05 * theirs["ppl"]        # the adapter matters


def _float_perplexity(model, text, adapter) -> float:
    """The model with the live adapter in float32 throughout (no llama.cpp activation rounding),
    chunked as llama-perplexity -c 128."""
    from app.engine.export.evaluate import perplexity_of_tokens

    tok = model.tokenizer
    tokens = tok.encode(text.read_text(), add_special=True)
    return perplexity_of_tokens(lambda chunk: model.logits(chunk, adapter=adapter,
                                                           llamacpp_numerics=False),
                                tokens, 128, tok.bos_id if tok.add_bos else None).ppl
