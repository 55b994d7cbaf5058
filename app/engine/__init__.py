"""The headless engine: importable and testable without Qt.

Public API: `load_model`, `load_tokenizer`, `load_adapter`, `Model`, `LoraAdapter` and the
errors of `app.engine.errors`. They are loaded on first use (module __getattr__), so
`import app.engine.errors`, the worker and the CLI's light commands import only what they use.
The packages, lowest layer first: runtime, kernels, io, text, model, data, training, runs,
export (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "EngineError": "app.engine.errors",
    "ModelFormatError": "app.engine.errors",
    "UnsupportedModelError": "app.engine.errors",
    "LoraAdapter": "app.engine.model.lora",
    "load_adapter": "app.engine.model.lora",
    "Model": "app.engine.model.transformer",
    "load_model": "app.engine.model.transformer",
    "load_tokenizer": "app.engine.text.tokenizer",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'app.engine' has no attribute {name!r}")
