"""One table of setting names (widgets.setting_labels): New run's fields and Compare's rows name
a setting alike (issue 29, item 5: Compare had its own LABELS, some names differing)."""

from __future__ import annotations

from PySide6.QtWidgets import QCheckBox

from app.views.new_run.settings_form import CONFIG_KEYS
from app.views.widgets.setting_labels import SETTING_LABELS, setting_label


def shown_name(form, key: str) -> str:
    widget = form[key]
    return widget.text() if isinstance(widget, QCheckBox) else form.label(key).text()


def test_every_new_run_field_is_named_by_the_table(new_run):
    form, sampling = new_run.form, new_run.grpo_panel.sampling
    assert set(CONFIG_KEYS.values()) <= set(SETTING_LABELS)
    for key, config_key in CONFIG_KEYS.items():
        assert shown_name(form, key) == SETTING_LABELS[config_key], key
    for key in sampling.fields:                   # GRPO's sampling: GrpoConfig's own keys
        assert shown_name(sampling, key) == SETTING_LABELS[key], key


def test_compare_names_a_setting_as_new_run_does(qtbot, new_run):
    from app.views.monitor import run_compare
    assert not hasattr(run_compare, "LABELS")      # no second table
    form = new_run.form
    for key in ("norms_every", "max_grad_norm", "expert_rank", "eps", "val_split"):
        assert run_compare.setting_label(CONFIG_KEYS[key]) == shown_name(form, key)
    assert setting_label("train.some_new_thing") == "Some new thing"
