"""New run's Load settings with malformed files: the error goes to the window's funnel naming
the keys, and the form stays exactly as it was (never half filled)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from app.engine.errors import EngineError
from app.engine.training.config import TrainConfig
from app.engine.training.preference import METHODS, PreferenceConfig
from tests.engine.training.test_config_schema import BAD_CONFIGS, GRPO_DICTS, RUN_DICTS, _bad_config_ids
from tests.engine.training.test_config_schema import section
from tests.fuzz import fuzz, fuzz_settings


@pytest.fixture
def view(new_run, ctx):
    new_run.errors = []
    ctx.error_reported.connect(lambda title, e, context: new_run.errors.append((title, e)))
    return new_run


@pytest.mark.parametrize("name,text,named", BAD_CONFIGS, ids=_bad_config_ids())
def test_a_malformed_settings_file_changes_nothing_and_says_why(view, tmp_path, name, text, named):
    view.form["rank"].setValue(12)
    before = (view.config_dict(), view.form.values())
    path = tmp_path / name
    path.write_text(text)
    view.load_settings(str(path))
    assert (view.config_dict(), view.form.values()) == before
    title, error = view.errors[-1]
    assert title == "Could not load the settings" and error.kind == "config"
    for part in named:
        assert part in error.message


# a preference run's settings (New run's DPO, ORPO, SimPO, KTO), random keys and values
PREFERENCE_DICTS = st.builds(lambda top, train, kind: {**top, "train": train, "kind": kind},
                             section(PreferenceConfig), section(TrainConfig),
                             st.sampled_from(METHODS))


@fuzz
@fuzz_settings(100, suppress=(HealthCheck.function_scoped_fixture,))
@given(st.one_of(RUN_DICTS, GRPO_DICTS.map(lambda d: {**d, "kind": "grpo"}), PREFERENCE_DICTS))
def test_load_settings_never_raises_and_never_half_fills(view, tmp_path, d):
    before = (view.kind(), view.config_dict())
    path = tmp_path / "random.json"
    path.write_text(json.dumps(d))
    n_errors = len(view.errors)
    view.load_settings(str(path))                   # any exception fails the test
    if len(view.errors) > n_errors:
        assert isinstance(view.errors[-1][1], EngineError)
        assert (view.kind(), view.config_dict()) == before


def test_an_evaluations_config_is_refused(view, tmp_path):
    """An evaluation's config.json is no training run's settings: refused with where to go (a
    preference run's, refused before its Method choice (0bc912f), now loads: see
    test_new_run_preference)."""
    before = (view.kind(), view.config_dict())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"kind": "eval", "model": "m.gguf"}))
    view.load_settings(str(path))
    title, error = view.errors[-1]
    assert error.kind == "config" and "New run does not start" in error.message
    assert "Evaluate" in error.hint
    assert (view.kind(), view.config_dict()) == before
