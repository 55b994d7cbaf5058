"""Models from the Hugging Face Hub: search, list a repository's GGUF models (split files as one,
quant types from the names and the headers), read a header with a ranged request (what fits
here), download into the Hugging Face cache with resume and a checksum (client.py); a split
model merged into one file to train (merge.py); the models already on this computer: the Hub's
cache, llama.cpp's, LM Studio's, Ollama's (local.py); names and specs (names.py); the GGUF
header's length and the fit (header.py).

Imports `huggingface_hub` (in its functions: `import app.engine.hub` stays light), the model
card and the training memory estimate (`header`), data's cache folder (`merge`), io and
runtime. Nothing below `training` imports it; the CLI (`workbench models`, `train -m
owner/name:QUANT`) and the window (through app.engine.api) do.

Settings (HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE, the token) are read at each call and handed to
the client explicitly (client.py says why), so the tests run the client in their own process
against tests/hub_server.py with HF_ENDPOINT set by monkeypatch.
"""
