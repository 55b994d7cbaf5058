"""Settings files: a New run screen's settings saved as JSON, or a run's config.json.

`read_settings(path)` reads one and checks it against the engine's config schema
(its run kind's config class: a RunConfig, with "kind": "grpo" a GrpoConfig, with "kind": dpo,
orpo, simpo or kto a PreferenceConfig; the model and dataset may be missing; an evaluation's
config is refused) before anything is shown: a file that does not parse, is not an object
or has unknown keys, values of the wrong type or out of range raises one ConfigError listing
them all. `write_settings(path, d)` writes one.
"""

from __future__ import annotations

import json
from pathlib import Path

from app.engine.api import (GRPO, KINDS, PREFERENCE_KINDS, ConfigError, check, kind_of,
                            read_config_file)


def read_settings(path: str) -> dict:
    d = read_config_file(path)
    kind = kind_of(d, path)
    if kind.name not in KINDS and kind.name not in PREFERENCE_KINDS:     # an evaluation's
        raise ConfigError(f"{Path(path).name} holds the settings of a {kind.label} run, which "
                          "New run does not start.",
                          "Load a training run's settings or config.json (Evaluate starts "
                          "evaluations).")
    inputs = {"prompts": ""} if kind is GRPO else {"data": ""}    # may be missing here
    check({"model": "", **inputs, **d}, kind.config_class, path)
    return d


def write_settings(path: str, d: dict) -> None:
    Path(path).write_text(json.dumps(d, indent=2) + "\n", encoding="utf-8")
