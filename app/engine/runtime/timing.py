"""Wall-clock time per phase of a training step, for bench/ and for anyone profiling a run.

The engine marks its phases with `phase(name)`: "forward" (embedding and blocks), "loss" (final
norm, output head and cross-entropy, forward and backward), "backward" (blocks and embedding),
"recompute" (blocks re-run under gradient checkpointing) and "optimizer". Phases never nest, so
their sum is the step. Dequantization happens inside them; `WeightStore.dequant_seconds` counts
it separately.

Timing is off unless a `PhaseClock` is active, and then costs one perf_counter pair per phase
(a handful per layer per step). One engine thread at a time, as everywhere in the engine.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

_active: "PhaseClock | None" = None


class PhaseClock:
    """Collects seconds per phase while active: `with PhaseClock() as clock: ...; clock.seconds`."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def __enter__(self) -> "PhaseClock":
        global _active
        self._outer, _active = _active, self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = self._outer


@contextmanager
def phase(name: str):
    clock = _active
    if clock is None:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        clock.seconds[name] += time.perf_counter() - t0
