"""Golden short run: 20 fixed-seed steps on the tiny golden MoE model reproduce recorded losses.

Any change to the forward, backward, LoRA init, optimizer or schedule moves these numbers. If a
change is intended, re-record with `python -m tests.engine.training.test_golden_run` and say why in the
commit. rtol 1e-4 allows float32 BLAS differences between CPUs; semantic changes are far larger.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from app.engine import load_model
from app.engine.training.config import TrainConfig
from app.engine.data.batches import pack
from app.engine.training.session import TrainSession
from tests.conftest import DATA, GOLDEN

RECORD = DATA / "golden_run.json"
TEXT = (b"An expert is someone who has made every mistake in a narrow field. "
        b"Mixture of experts routes each token to two of four experts. ")
CONFIG = TrainConfig(mode="lora", lora_rank=4, lora_alpha=8.0,
                     lora_targets=("attention", "experts", "router"), optimizer="adamw", lr=2e-2,
                     weight_decay=0.01, gclip=0.5, schedule="cosine", warmup_steps=3, min_lr=1e-3,
                     max_grad_norm=0.0, max_steps=20, seed=1234,
                     precision="fp32")                    # the recorded losses are float32's


def golden_run_losses() -> list[float]:
    model = load_model(GOLDEN / "mixtral-q8_0.gguf")
    session = TrainSession(model, CONFIG)
    ids = np.frombuffer(TEXT, np.uint8).astype(np.int64)
    half = ids.size // 2
    batch = [pack([(ids[:half - 1], ids[1:half]), (ids[half:-1], ids[half + 1:])])]
    return [session.step(batch).loss for _ in range(CONFIG.max_steps)]


def test_golden_short_run_reproduces_recorded_losses():
    recorded = json.loads(RECORD.read_text())["losses"]
    losses = golden_run_losses()
    np.testing.assert_allclose(losses, recorded, rtol=1e-4)
    assert losses[-1] < 0.7 * losses[0]


if __name__ == "__main__":
    RECORD.write_text(json.dumps({"model": "mixtral-q8_0.gguf", "config": str(CONFIG),
                                  "losses": golden_run_losses()},
                                 indent=1) + "\n")
    print(Path(RECORD).read_text())
