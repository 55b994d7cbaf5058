"""Settings files: a New run screen's settings saved as JSON, or a run's config.json.

`read_settings(path)` reads one and checks it against the engine's config schema
(app.engine.runtime.schema: a RunConfig, or with "kind": "grpo" a GrpoConfig; the model and
dataset may be missing) before anything is shown: a file that does not parse, is not an object
or has unknown keys, values of the wrong type or out of range raises one ConfigError listing
them all. `write_settings(path, d)` writes one.
"""

from __future__ import annotations

import json
from pathlib import Path

from app.engine.runtime.schema import check, read_config_file


def read_settings(path: str) -> dict:
    from app.engine.training.grpo import GrpoConfig
    from app.engine.training.sft import RunConfig

    d = read_config_file(path)
    if d.get("kind") == "grpo":
        check({"model": "", "prompts": "", **d}, GrpoConfig, path)
    else:
        check({"model": "", "data": "", **d}, RunConfig, path)
    return d


def write_settings(path: str, d: dict) -> None:
    Path(path).write_text(json.dumps(d, indent=2) + "\n", encoding="utf-8")
