"""Models on this computer: the Hugging Face cache beside llama.cpp's, LM Studio's, Ollama's."""

from __future__ import annotations

import os

from app.engine.hub import client
from app.engine.hub.local import discover_models
from app.engine.hub.names import parse_spec


def test_the_hub_cache_is_found_with_repo_and_quant(hub, tmp_path):
    models = client.list_models("wb-test/tiny-llama-GGUF")
    path = client.download(client.choose(models, parse_spec("wb-test/tiny-llama-GGUF:Q8_0")))
    found = discover_models(tmp_path / "home", env={"HF_HOME": os.environ["HF_HOME"]})
    assert [(f.name, f.source, f.path) for f in found] == [
        ("wb-test/tiny-llama-GGUF:Q8_0", "Hugging Face", str(path))]
    assert discover_models(tmp_path / "home", env={}) == []     # ~/.cache/huggingface: empty
