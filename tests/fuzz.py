"""Hypothesis settings shared by the property tests: bounded for CI, longer on request.

Every property test is marked `fuzz` (`pytest -m fuzz` runs them alone). By default each runs
its own bounded number of examples, derandomized, so CI tests the same cases every time and
stays within its time. `WORKBENCH_FUZZ=long pytest -m fuzz` multiplies every count by 20 and
draws fresh random cases each run: the longer hunt, by hand or on a schedule.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, settings

LONG = os.environ.get("WORKBENCH_FUZZ", "").lower() == "long"
LONG_FACTOR = 20


def fuzz_settings(max_examples: int, deadline: timedelta | None = None,
                  suppress: tuple[HealthCheck, ...] = ()):
    """@settings for a property test (add @fuzz beside it)."""
    return settings(max_examples=max_examples * (LONG_FACTOR if LONG else 1), deadline=deadline,
                    derandomize=not LONG, database=None, print_blob=LONG,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           *suppress])


fuzz = pytest.mark.fuzz
