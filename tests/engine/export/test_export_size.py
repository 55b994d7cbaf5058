"""expected_export_size: what the window shows before writing is what the export then writes
(within a few %: GGUF files exactly, PEFT and Ollama up to their headers' and text files'
estimate), for every format and type, on the sample models."""

from __future__ import annotations

import os

import pytest

from app.engine.errors import ConfigError
from app.engine.export.exporter import (ExportSource, expected_export_size, export,
                                        source_from_adapter)
from tests.conftest import GOLDEN

CASES = [("gguf-lora", t) for t in ("f32", "f16", "bf16", "q8_0")] + \
        [("merged", t) for t in ("f16", "f32", "q8_0")] + \
        [("peft", "f32"), ("peft", "f16"), ("ollama", "f32"), ("ollama", "f16")]


def _source(name):
    return source_from_adapter(GOLDEN / f"{name}-lora.gguf", GOLDEN / f"{name}-f32.gguf")


@pytest.mark.parametrize("name", ["mixtral", "gemma3"])       # gemma3: Ollama merges
@pytest.mark.parametrize("to, adapter_type", CASES)
def test_the_estimate_is_the_written_size(tmp_path, name, to, adapter_type):
    source = _source(name)
    estimate = expected_export_size(source, to, adapter_type)
    out = tmp_path / ("out.gguf" if to in ("gguf-lora", "merged") else "out")
    report = export(source, to, out, adapter_type=adapter_type, llamacpp=False,
                    write_report=False)
    written = sum(os.path.getsize(f) for f in report.files)
    assert report.ok and estimate == pytest.approx(written, rel=0.04)
    if to == "gguf-lora":
        assert estimate == written              # computed from the same layout


def test_a_format_that_cannot_carry_the_source_says_why():
    full = ExportSource(str(GOLDEN / "llama-f32.gguf"), None, {"x": None})
    with pytest.raises(ConfigError, match="no LoRA adapter"):
        expected_export_size(full, "gguf-lora")
    with pytest.raises(ConfigError, match="Unknown adapter type"):
        expected_export_size(_source("llama"), "peft", "q4_k")
