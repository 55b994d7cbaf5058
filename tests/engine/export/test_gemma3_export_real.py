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
