"""Errors the engine raises for bad input or bad state.

Every error carries a ``kind`` (a stable machine-readable tag), a plain-language ``message``
(what happened) and a ``hint`` (what the user can do). Anything that is not an EngineError is a
bug and travels with its traceback.
"""

from __future__ import annotations

import sys


class EngineError(Exception):
    kind = "engine"

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message

    def to_dict(self) -> dict:
        return {"kind": self.kind, "message": self.message, "hint": self.hint}


class ModelFormatError(EngineError):
    """The file is not a readable GGUF model (truncated, corrupt, inconsistent)."""

    kind = "model_format"


class UnsupportedModelError(EngineError):
    """A valid GGUF file whose architecture or tensor type the engine does not support."""

    kind = "unsupported_model"


class DatasetError(EngineError):
    kind = "dataset"


class ConfigError(EngineError):
    kind = "config"


class TemplateError(EngineError):
    """A chat template ran past its time or size budget (`app.engine.text.chat_template`). Not a
    ConfigError on purpose: the data pipeline rejects a row on a ConfigError and goes on with
    the next one, whereas a template over budget must stop the whole run at once."""

    kind = "template"


class OutOfMemoryError(EngineError):
    kind = "out_of_memory"


class CheckpointError(EngineError):
    kind = "checkpoint"


class Cancelled(EngineError):
    kind = "cancelled"


class MissingModuleError(EngineError):
    """This Python lacks a module the workbench imports (a package not installed, or a
    cluster's Python without the workbench): an installation to fix, not a bug to report, and
    never mended by running the same thing again."""

    kind = "missing_module"

    @classmethod
    def of(cls, error: ModuleNotFoundError) -> "MissingModuleError | None":
        """The error for `error`, or None when the module missing is one of the workbench's own
        (`app...`: that is a bug)."""
        name = error.name or ""
        if name == "app" or name.startswith("app."):
            return None
        return cls(f"This Python ({sys.executable}) cannot run the workbench: {error}.",
                   "Install the workbench with its dependencies into this Python (`pip install "
                   "gguf-workbench`, or `pip install -e .` in its folder); for a cluster, name "
                   "the Python that has it: `workbench cluster add NAME URL --python PATH`.")
