"""Settings files: a New run screen's settings saved as JSON, or a run's config.json.

`read_settings(path)` reads one and checks it the way the engine will (a RunConfig, or with
"kind": "grpo" a GrpoConfig; the model and dataset may be missing): a file that is not JSON,
not an object or holds unknown settings raises ConfigError with a hint. `write_settings(path,
d)` writes one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from app.engine.errors import ConfigError


def read_settings(path: str) -> dict:
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"Could not read {os.path.basename(path)}: {e}.",
                          "Pick a settings file saved by the workbench or a run's "
                          "config.json.") from e
    if not isinstance(d, dict):
        raise ConfigError(f"{os.path.basename(path)} is not a settings file.")
    if d.get("kind") == "grpo":                                 # unknown keys -> ConfigError
        from app.engine.grpo import GrpoConfig

        GrpoConfig.from_dict({"model": "", "prompts": "", **d})
    else:
        from app.engine.run import RunConfig

        RunConfig.from_dict({"model": "", "data": "", **d})
    return d


def write_settings(path: str, d: dict) -> None:
    Path(path).write_text(json.dumps(d, indent=2) + "\n", encoding="utf-8")
