"""The events of a run's metrics.jsonl: the ONE schema the loops write and the readers read.

Every line of metrics.jsonl is a JSON object: the envelope (`type`: one of the kinds below;
`time`: added when it is recorded, app.engine.runs.rundir) and the fields of its kind. The
events of a GRPO run whose fields differ from a supervised run's (start, step, eval, samples,
done) also carry `kind`: "grpo"; log, norms, routing and checkpoint events are the same for
every run kind. The loops build their events with the schemas here, which refuse a missing or
unknown field (a bug), e.g. `report(SFT_STEP(step=1, loss=2.3, ...))`; readers use the kind
constants and `STATUS_FIELDS`, and `problems(event)` checks a recorded event.

Lives in `training` so that the loops can import it; `runs` and the views read it from here.
"""

from __future__ import annotations

from dataclasses import dataclass

# The run kinds whose events differ (config.json's "kind"; app.engine.runs.kinds is the registry).
SFT_RUN, GRPO_RUN = "sft", "grpo"
PREFERENCE_RUNS = ("dpo", "orpo", "simpo", "kto")   # app.engine.training.preference

# The envelope.
TYPE, TIME, RUN_KIND = "type", "time", "kind"

# The event kinds (an event's `type`; a recorded event without one is a step).
START, STEP, EVAL, SAMPLES, NORMS, ROUTING, CHECKPOINT, LOG, DONE = (
    "start", "step", "eval", "samples", "norms", "routing", "checkpoint", "log", "done")

# The fields of a step event that status.json keeps (app.engine.runs.reporter; reward_mean: GRPO).
STATUS_FIELDS = ("step", "total_steps", "epoch", "epochs", "loss", "accuracy", "lr",
                 "tokens_per_s", "elapsed_s", "eta_s", "reward_mean")
# The fields of an eval event that status.json keeps (preference runs' held-out headline).
EVAL_STATUS_FIELDS = ("eval_rewards/accuracies", "eval_rewards/margins")


@dataclass(frozen=True)
class EventSchema:
    """One kind of event: its fields (every event has them), its optional fields and, for a
    GRPO event, the run kind it carries. Calling it builds the event."""

    type: str
    fields: tuple[str, ...]
    optional: tuple[str, ...] = ()
    run_kind: str | None = None

    def __call__(self, **fields) -> dict:
        event = {TYPE: self.type, **({RUN_KIND: self.run_kind} if self.run_kind else {}),
                 **fields}
        wrong = self.problems(event)
        if wrong:
            raise ValueError(f"a {self.type} event: " + "; ".join(wrong))
        return event

    def problems(self, event: dict) -> list[str]:
        """What is wrong with `event`'s fields (the envelope aside): missing, unknown."""
        keys = set(event) - {TYPE, TIME, RUN_KIND}
        missing = [f for f in self.fields if f not in keys]
        unknown = sorted(keys - set(self.fields) - set(self.optional))
        return ([f"missing {', '.join(missing)}"] if missing else []) + \
               ([f"unknown {', '.join(unknown)}"] if unknown else [])


# ---- every run kind ----------------------------------------------------------------------------

LOG_EVENT = EventSchema(LOG, ("message",))
NORMS_EVENT = EventSchema(NORMS, ("step", "tensors"))          # {tensor: LoRA norms}
ROUTING_EVENT = EventSchema(ROUTING, ("step", "layers"))       # {layer: expert fractions}
CHECKPOINT_EVENT = EventSchema(CHECKPOINT, ("step", "tag"))

# What a step of any run kind reports (times in seconds).
TRAIN_STEP = ("step", "total_steps", "epoch", "epochs", "loss", "accuracy", "lr", "grad_norm",
              "clipped_fraction", "tokens", "tokens_per_s", "skipped", "elapsed_s", "eta_s",
              "rss_mb")

# ---- supervised runs (app.engine.training.sft) -------------------------------------------------

# precision: what the frozen base's products compute in and why (app.engine.runtime.bf16:
# Precision.reason, e.g. "bf16: AVX512-BF16 via oneDNN"); status.json keeps it.
SFT_START = EventSchema(START, ("total_steps", "epochs", "steps_per_epoch", "trainable",
                                "train_rows", "val_rows", "skipped_rows", "resumed_at"),
                        optional=("precision",))
SFT_STEP = EventSchema(STEP, TRAIN_STEP + ("epoch_loss", "epoch_loss_se", "epoch_accuracy",
                                           "epoch_accuracy_se"))
SFT_EVAL = EventSchema(EVAL, ("step", "loss", "accuracy", "perplexity", "best"),
                       ("task", "task_acc"))      # --eval-task: its name and accuracy
SFT_DONE = EventSchema(DONE, ("step", "reason", "best_step", "best_loss", "skipped_steps",
                              "elapsed_s"))

# ---- GRPO runs (app.engine.training.grpo: its docstring says what the fields mean) ---------------

GRPO_START = EventSchema(START, ("total_steps", "epochs", "trainable", "prompt_rows",
                                 "train_prompts", "val_prompts", "skipped_rows", "group_size",
                                 "prompts_per_step", "advantage", "kl", "rewards", "resumed_at"),
                         optional=("precision",), run_kind=GRPO_RUN)
GRPO_STEP = EventSchema(STEP, TRAIN_STEP + (
    "reward_mean", "reward_std", "rewards", "zero_spread_fraction", "completion_len_mean",
    "completion_len_min", "completion_len_max", "completion_clipped_fraction", "advantage_mean",
    "advantage_std", "advantage_abs_mean", "kl", "sample_s", "reward_s", "update_s", "step_s",
    "sample_tokens_per_s"), run_kind=GRPO_RUN)
GRPO_SAMPLES = EventSchema(SAMPLES, ("step", "items"), run_kind=GRPO_RUN)
GRPO_EVAL = EventSchema(EVAL, ("step", "prompts", "reward_mean", "reward_std", "rewards",
                               "completion_len_mean", "completion_clipped_fraction", "examples",
                               "eval_s"), optional=("sampled",), run_kind=GRPO_RUN)
GRPO_DONE = EventSchema(DONE, ("step", "reason", "skipped_steps", "elapsed_s"),
                        run_kind=GRPO_RUN)

# ---- preference runs (app.engine.training.preference; TRL's metric names) -------------------------

PAIR_METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins",
                "rewards/accuracies", "logps/chosen", "logps/rejected")
METHOD_METRICS = {"dpo": ("nll_loss",), "simpo": ("nll_loss",), "kto": ("kl",),
                  "orpo": ("nll_loss", "log_odds_ratio", "log_odds_chosen")}


def preference_schemas(method: str) -> tuple[EventSchema, ...]:
    """The start, step, eval and done events of a `method` run (they carry "kind": method). A
    step has the step's rows' metrics (accuracy: rewards/accuracies), an eval the held-out
    rows' with the eval_ prefix."""
    extra = METHOD_METRICS[method]
    return (EventSchema(START, ("total_steps", "epochs", "trainable", "train_rows", "val_rows",
                                "skipped_rows", "pairs_per_step", "method", "loss_type", "beta",
                                "reference", "resumed_at"), run_kind=method),
            EventSchema(STEP, TRAIN_STEP + PAIR_METRICS[1:] + ("rows",), optional=extra,
                        run_kind=method),
            EventSchema(EVAL, ("step", "rows", "best", "eval_s")
                        + tuple("eval_" + m for m in PAIR_METRICS),
                        optional=tuple("eval_" + m for m in extra), run_kind=method),
            EventSchema(DONE, ("step", "reason", "best_step", "best_accuracy", "skipped_steps",
                               "elapsed_s"), run_kind=method))


_COMMON = (LOG_EVENT, NORMS_EVENT, ROUTING_EVENT, CHECKPOINT_EVENT)
SCHEMAS = {run_kind: {s.type: s for s in _COMMON + own} for run_kind, own in (
    (SFT_RUN, (SFT_START, SFT_STEP, SFT_EVAL, SFT_DONE)),
    (GRPO_RUN, (GRPO_START, GRPO_STEP, GRPO_SAMPLES, GRPO_EVAL, GRPO_DONE)),
    *((m, preference_schemas(m)) for m in PREFERENCE_RUNS))}


def event_type(event: dict) -> str:
    """A recorded event's kind (none: a step, as app.engine.runs.rundir records it)."""
    return str(event.get(TYPE, STEP))


def problems(event: dict, run_kind: str = SFT_RUN) -> list[str]:
    """What is wrong with a recorded event of a run of `run_kind` ([] when it fits the schema):
    an unknown type, a GRPO event without its `kind`, missing or unknown fields."""
    schemas = SCHEMAS.get(run_kind, {})
    schema = schemas.get(event_type(event))
    if schema is None:
        return [f"{event_type(event)!r} is not an event of {run_kind} runs"]
    if event.get(RUN_KIND) != schema.run_kind:
        return [f"a {schema.type} event of {run_kind} runs carries kind "
                f"{event.get(RUN_KIND)!r}, not {schema.run_kind!r}"]
    return schema.problems(event)


def describe(event: dict) -> str | None:
    """The line a person reads for an event that is not a curve (log, start, checkpoint, done),
    or None. app.engine.runs.reporter writes it to the run's log.txt as it records the event,
    so log.txt tells the run's story in the order it happened, the job's own lines included."""
    kind = event_type(event)
    if kind == LOG:
        text = str(event.get("message", ""))
    elif kind == START and event.get(RUN_KIND) == GRPO_RUN:
        text = (f"start: {event.get('total_steps')} steps of {event.get('prompts_per_step')} "
                f"prompts x {event.get('group_size')} completions, "
                f"{event.get('trainable', 0):,} trainable parameters, "
                f"{event.get('train_prompts')} training / {event.get('val_prompts')} held-out "
                f"prompts ({event.get('skipped_rows')} skipped)")
    elif kind == START:
        text = (f"start: {event.get('total_steps')} steps, {event.get('epochs')} epoch(s), "
                f"{event.get('trainable', 0):,} trainable parameters, "
                f"{event.get('train_rows')} train / {event.get('val_rows')} validation rows")
    elif kind == CHECKPOINT:
        tag = f" ({event['tag']})" if event.get("tag") else ""
        text = f"checkpoint at step {event.get('step')}{tag}"
    elif kind == DONE:
        best = event.get("best_loss")
        text = f"done at step {event.get('step')}: {event.get('reason', 'finished')}"
        if isinstance(best, (int, float)):
            text += f", best validation loss {best:.4f} at step {event.get('best_step')}"
    else:
        return None
    if kind == START and event.get("resumed_at"):
        text += f", resumed at step {event['resumed_at']}"
    if kind == START and event.get("precision"):
        text += f"; products in {event['precision']}"
    return text
