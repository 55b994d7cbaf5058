"""The headless engine: importable and testable without Qt.

Public API: `load_model`, `load_tokenizer`, `load_adapter`, the errors in `app.engine.errors`.
"""

from app.engine.errors import EngineError, ModelFormatError, UnsupportedModelError
from app.engine.lora import LoraAdapter, load_adapter
from app.engine.model import Model, load_model


def load_tokenizer(path):
    """The tokenizer of any GGUF file, vocab-only files included."""
    from app.engine.tokenizer import load_tokenizer as _load

    return _load(path)


__all__ = ["EngineError", "ModelFormatError", "UnsupportedModelError", "LoraAdapter", "Model",
           "load_adapter", "load_model", "load_tokenizer"]
