"""Phase timing: off by default, and when on, the phases of a step cover it."""

from __future__ import annotations

import time

import numpy as np

from app.engine import load_model
from app.engine.training.config import TrainConfig
from app.engine.runtime.timing import PhaseClock, phase
from app.engine.data.batches import Batch
from app.engine.training.session import TrainSession
from tests.conftest import GOLDEN


def _session(checkpoint_interval: int) -> tuple[TrainSession, Batch]:
    model = load_model(GOLDEN / "mixtral-q8_0.gguf")
    config = TrainConfig(mode="lora", lora_rank=4, lora_alpha=8, max_steps=10,
                         lora_targets=("attention", "experts"),
                         checkpoint_interval=checkpoint_interval)
    tokens = np.random.default_rng(0).integers(0, model.config.n_vocab, 64)
    return TrainSession(model, config), Batch(tokens, np.roll(tokens, -1))


def test_phases_of_a_checkpointed_step_cover_the_step():
    session, batch = _session(checkpoint_interval=1)
    with PhaseClock() as clock:
        t0 = time.perf_counter()
        session.step([batch])
        step = time.perf_counter() - t0
    assert set(clock.seconds) == {"forward", "loss", "recompute", "backward", "optimizer"}
    covered = sum(clock.seconds.values())
    assert 0.8 * step < covered <= step


def test_no_recompute_without_checkpointing_and_nothing_recorded_outside_a_clock():
    session, batch = _session(checkpoint_interval=0)
    with PhaseClock() as clock:
        session.step([batch])
    assert "recompute" not in clock.seconds
    with phase("forward"):                      # no active clock: a no-op
        pass
    assert clock.seconds["forward"] > 0
    with PhaseClock() as outer:
        with PhaseClock() as inner:
            with phase("x"):
                pass
        assert "x" in inner.seconds and "x" not in outer.seconds
