"""New run's expert rank and the memory of each target group (issue 20: a user sees that the
experts dominate and can trade their rank for memory)."""

from __future__ import annotations

from app.engine.api import TARGET_GROUPS, human_bytes, lora_param_count


def test_expert_rank_sets_the_experts_count_memory_and_config(qtbot, new_run):
    form = new_run.form
    shapes = new_run.card.tensor_shapes
    assert form.has_experts() and form.fields["expert_rank"].isVisibleTo(form)
    assert form.fields["expert_rank"].text() == "auto"                     # None in the config
    assert form.values()["train"]["expert_rank"] is None
    experts = TARGET_GROUPS["experts"]
    assert form.group_counts()["experts"] == lora_param_count(shapes, 8, experts)   # 8 experts
    attention_before = form.group_counts()["attention"]

    form.fields["expert_rank"].setValue(2)
    n = lora_param_count(shapes, 8, experts, expert_rank=2)
    assert form.group_counts()["experts"] == n < lora_param_count(shapes, 8, experts)
    assert form.group_counts()["attention"] == attention_before            # rank unchanged
    assert form.target_counts["experts"].text().endswith(f"params \u00b7 {human_bytes(n * 16)}")
    assert form.trainable_params() == sum(form.group_counts()[g] for g in form.targets())
    assert form.values()["train"]["expert_rank"] == 2
    assert new_run.memory_estimate is not None

    form.set_values({"train": {"expert_rank": 4}})                           # a loaded run
    assert form.fields["expert_rank"].value() == 4
    form.set_values({"train": {}})
    assert form.expert_rank() is None


def test_expert_rank_is_hidden_for_a_dense_model(qtbot, new_run):
    form = new_run.form
    card = new_run.card
    dense = type(card)(**{**card.__dict__, "tensor_shapes": {
        n: s for n, s in card.tensor_shapes.items() if len(s) < 3}})
    form.set_card(dense)
    assert not form.has_experts() and not form.fields["expert_rank"].isVisibleTo(form)
