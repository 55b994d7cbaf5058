"""Preference runs: DPO (sigmoid, hinge, IPO), ORPO, SimPO and KTO on chosen/rejected data.

A step takes `pairs_per_step` rows of the training split (one seeded permutation per pass, as
GRPO takes its prompts), and for each row its completions with their prompts (a pair: chosen
then rejected; KTO: the row's completion, plus a forward-only mismatched sequence of its prompt
with the previous row's completion for the KL estimate). The step is then:

1. the completions' summed log-probabilities under the policy (`Model.label_log_probs`: the
   loss head's forward, no (T, V) logits kept), chosen and rejected packed into the same
   micro-batches (attention never crosses a sequence);
2. the reference's, for DPO and KTO: the same forward with the LoRA adapter off (the base: no
   second model, no backward), or with the adapter the run started from (`adapter`, the CLI's
   `--init-adapter`), or for full fine-tuning the model file's own weights (never changed);
3. the loss and dL/dlogp of every completion in float64 (app.engine.training.preference_losses,
   TRL's formulas);
4. ONE ordinary training step (TrainSession.step) on the same micro-batches with per-token
   weights w_t = -dL/dlogp_s x N (N the step's completion tokens; the session divides by N), whose
   gradient is exactly grad L = sum_s dL/dlogp_s grad logp_s.

So a step costs two policy forwards, one backward and (DPO, KTO) one reference forward; the
reference forward runs before the step's own forward and backward and keeps nothing alive, so
it adds no memory at the peak (the estimate is the training step's; a run from an existing
adapter holds a second copy of it, a few MB). LoRA dropout is refused (the weights are computed
without it) and so is L-BFGS (it re-evaluates the loss with fixed weights).

Metrics carry TRL's names (loss, rewards/chosen, rewards/rejected, rewards/margins,
rewards/accuracies, logps/chosen, logps/rejected; ORPO nll_loss, log_odds_ratio,
log_odds_chosen; KTO kl) on the step's rows and, in eval events, on every held-out row with the
eval_ prefix: at step 0, every `eval_every` steps and at the end. The best checkpoint is the one
with the highest held-out accuracy, then margin. A KTO run on a paired file trains on each
pair's two completions as a desirable and an undesirable row (TRL's unpair_preference_dataset)
and its held-out accuracy compares each pair's two rewards; on unpaired rows a row counts as
right when its reward's sign is its label's.

Steps are a pure function of (data, config, step): a run paused or killed and resumed from a
checkpoint trains exactly as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, Sequence as Seq

import numpy as np

from app.engine.data.batches import Batch
from app.engine.data.preferences import (KTO, PreferenceItem, Sequence, load_preferences,
                                         unpaired)
from app.engine.errors import ConfigError, DatasetError
from app.engine.model.lora import load_adapter
from app.engine.model.transformer import load_model
from app.engine.runtime.backend import peak_rss_mb, to_host
from app.engine.runtime.inputs import StopCheck
from app.engine.runtime.schema import (AT_LEAST_0, AT_LEAST_1, FRACTION, POSITIVE, TEXT, Range,
                                       check)
from app.engine.training import events, fingerprints
from app.engine.training import preference_losses as losses
from app.engine.training.config import TrainConfig
from app.engine.training.grpo import step_prompts
from app.engine.training.memory import check_run_memory, run_cache_budget
from app.engine.training.session import TrainSession
from app.engine.training.sft import (RUN_LENGTHS, before_training, between_steps,
                                     checkpoint_saver, finish_run, guarded_step, resume)

Report = Callable[[dict], None]
ShouldStop = Callable[[], "str | None"]

METHODS = events.PREFERENCE_RUNS
DEFAULT_BETA = {"dpo": 0.1, "simpo": 2.0, "kto": 0.1, "orpo": 0.1}   # TRL's; SimPO's paper
USES_REFERENCE = ("dpo", "kto")
METHOD_TITLES = {"dpo": "DPO (preference pairs)", "orpo": "ORPO (pairs, no reference)",
                 "simpo": "SimPO (pairs, no reference)", "kto": "KTO (good/bad completions)"}
HEADLINE = "eval_rewards/accuracies"     # what Runs shows and the best checkpoint maximises



# ---- configuration -------------------------------------------------------------------------------

@dataclass(frozen=True)
class PreferenceConfig:
    """One preference run, completely (config.json with "kind": its method).

    data: a preference file (app.engine.data.preferences); context: the most tokens of a
    prompt with a completion (+1), longer rows are rejected. beta None: the method's default
    (DEFAULT_BETA). pref_loss: DPO's loss (sigmoid, hinge, ipo). sft_weight: DPO/SimPO's
    optional NLL term on the chosen completion (TRL's rpo_alpha / cpo_alpha). orpo_lambda:
    ORPO's weight of the odds-ratio term. simpo_gamma: SimPO's target margin. adapter: start
    from this GGUF LoRA adapter, which is then also the reference.
    """

    model: str
    data: str
    method: str = "dpo"
    train: TrainConfig = field(default_factory=TrainConfig)
    context: int = 256
    val_split: float = 0.0
    val_data: str | None = None
    completion_as_chat: bool = False
    chat_template: str | None = None
    pairs_per_step: int = 8
    epochs: int = 3
    max_steps: int = 0           # 0: epochs x ceil(rows / pairs_per_step)
    eval_every: int = 10         # steps between evaluations (0: at the start and the end)
    save_every: int = 25         # steps between checkpoints (0: only at pause and end)
    keep_last: int = 2
    norms_every: int = 10
    max_bad_steps: int = 5
    micro_batch_tokens: int = 2048
    adapter: str | None = None
    beta: float | None = None
    pref_loss: str = "sigmoid"
    label_smoothing: float = 0.0
    sft_weight: float = 0.0
    orpo_lambda: float = 0.1
    simpo_gamma: float = 0.5
    kto_desirable_weight: float = 1.0
    kto_undesirable_weight: float = 1.0

    SCHEMA_RULES: ClassVar[dict] = dict(
        kind=METHODS, model=TEXT, data=TEXT, method=METHODS, context=AT_LEAST_1,
        val_split=FRACTION, val_data=TEXT, chat_template=TEXT,
        pairs_per_step=Range(1, 4096), epochs=AT_LEAST_0, max_steps=AT_LEAST_0,
        micro_batch_tokens=AT_LEAST_1, beta=POSITIVE, pref_loss=losses.DPO_LOSSES,
        label_smoothing=Range(0, 0.5), sft_weight=AT_LEAST_0, orpo_lambda=AT_LEAST_0,
        simpo_gamma=AT_LEAST_0, kto_desirable_weight=AT_LEAST_0,
        kto_undesirable_weight=AT_LEAST_0, **RUN_LENGTHS)

    @property
    def effective_beta(self) -> float:
        return self.beta if self.beta is not None else DEFAULT_BETA[self.method]

    def validate(self) -> None:
        check(self.to_dict(), PreferenceConfig)
        self.train.validate()
        if self.method not in METHODS:
            raise ConfigError(f"Unknown preference method {self.method!r}.",
                              "Use one of: " + ", ".join(METHODS) + ".")
        if self.train.lora_dropout:
            raise ConfigError("Preference runs take no LoRA dropout.",
                              "Set the dropout to 0: the loss's weights are computed without it.")
        if self.train.optimizer == "lbfgs":
            raise ConfigError("Preference runs do not support L-BFGS.", "Use adamw or sgd.")
        if not self.epochs and not self.max_steps:
            raise ConfigError("A run needs a number of epochs or of steps.",
                              "Set epochs, or max_steps with epochs 0.")
        if self.val_split and self.val_data:
            raise ConfigError("Both a validation fraction and a validation file are set.",
                              "Choose one of them.")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d = {"kind": d.pop("method"), **d}
        d["train"] = {k: list(v) if isinstance(v, tuple) else v for k, v in d["train"].items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "PreferenceConfig":
        """From a config.json dict (its "kind" is the method); every unknown key, wrong type
        or value out of range is listed in one ConfigError."""
        check(d, cls)
        d = dict(d)
        method = d.pop("kind", d.pop("method", "dpo"))
        d.pop("method", None)
        train = TrainConfig.from_dict(d.pop("train", {}))
        return cls(method=method, train=train, **d)


def build_preference_config(d: dict) -> PreferenceConfig:
    """The validated config a new run starts from (`d` as the CLI gathers it); the model, data
    and adapter paths made absolute (the worker runs elsewhere)."""
    d = dict(d)
    if not d.get("model") or not d.get("data"):
        raise ConfigError("A preference run needs a model and a dataset.",
                          "Pass --model and --data.")
    check(d, PreferenceConfig)
    for key in ("model", "data", "adapter", "val_data"):
        if d.get(key):
            d[key] = str(Path(d[key]).expanduser().resolve())
    config = PreferenceConfig.from_dict(d)
    config.validate()
    return config


# ---- events ---------------------------------------------------------------------------------------

SCHEMAS = events.SCHEMAS       # by method: app.engine.training.events.preference_schemas


def problems(event: dict, method: str) -> list[str]:
    """What is wrong with a recorded event of a `method` run ([] when it fits)."""
    return events.problems(event, method)


# ---- sequences -> micro-batches -------------------------------------------------------------------

def pack(seqs: Seq[Sequence], coefs: Seq[float] | None = None,
         max_tokens: int = 2048) -> tuple[list[Batch], list[tuple[int, slice]]]:
    """Micro-batches of sequences (each: tokens ids[:-1], labels ids[1:] on its target tokens
    and -1 elsewhere, token weight coefs[s] on its targets), packed greedily in order into at
    most `max_tokens` positions (a longer sequence alone), attention within each sequence only.
    Also where each sequence's positions are: (micro-batch, slice)."""
    batches, where, current, size = [], [], [], 0

    def flush():
        tokens, labels, weights, positions, segments = [], [], [], [], []
        for k, (s, c) in enumerate(current):
            lab = np.where(s.trained[1:], s.ids[1:], -1).astype(np.int64)
            tokens.append(s.ids[:-1].astype(np.int64))
            labels.append(lab)
            weights.append(np.where(lab >= 0, c, 0.0).astype(np.float32))
            positions.append(np.arange(len(s.ids) - 1))
            segments.append(np.full(len(s.ids) - 1, k))
        batches.append(Batch(np.concatenate(tokens), np.concatenate(labels),
                             np.concatenate(weights), np.concatenate(positions),
                             np.concatenate(segments)))

    for i, s in enumerate(seqs):
        length = len(s.ids) - 1
        if current and size + length > max_tokens:
            flush()
            current, size = [], 0
        where.append((len(batches), slice(size, size + length)))
        current.append((s, 1.0 if coefs is None else float(coefs[i])))
        size += length
    if current:
        flush()
    return batches, where


def sequence_log_probs(model, params, seqs: Seq[Sequence], max_tokens: int,
                       vocab_chunk: int) -> np.ndarray:
    """(S,) float64: each sequence's summed log-probability of its target tokens under
    `params` (forward only)."""
    batches, where = pack(seqs, None, max_tokens)
    per_token = [np.asarray(to_host(model.label_log_probs(
        params, b.tokens, b.labels, b.positions, b.segments, vocab_chunk)), np.float64)
        for b in batches]
    return np.array([per_token[b][sl].sum() for b, sl in where], np.float64)


def completion_tokens(seqs: Seq[Sequence]) -> np.ndarray:
    return np.array([s.completion_tokens for s in seqs], np.float64)


def mismatched(items: Seq[PreferenceItem], max_len: int) -> list[Sequence]:
    """KTO's KL sequences: row i's prompt with row i-1's completion (TRL shifts the completions
    by one within the batch), cut to `max_len` tokens. A sequence's prompt is everything before
    its first target token."""
    def split(s: Sequence) -> int:
        return int(np.argmax(s.trained[1:])) + 1
    out = []
    for i, it in enumerate(items):
        other = items[i - 1].chosen
        a, b = split(it.chosen), split(other)
        ids = np.concatenate([it.chosen.ids[:a], other.ids[b:]])[:max_len]
        trained = np.concatenate([np.zeros(a, bool), other.trained[b:]])[:max_len]
        if not trained[1:].any():        # the prompt filled the length: keep one target
            trained = trained.copy()
            trained[-1] = True
        out.append(Sequence(ids, trained))
    return out


# ---- the loss of a batch of rows ----------------------------------------------------------------

@dataclass
class RowBatch:
    """The sequences of some rows and what the loss needs of them."""

    items: list[PreferenceItem]
    seqs: list[Sequence]          # pairs: c0, r0, c1, r1, ...; KTO: the rows' completions
    kl_seqs: list[Sequence]       # KTO: the mismatched sequences (forward only)


def row_batch(items: Seq[PreferenceItem], method: str, context: int) -> RowBatch:
    items = list(items)
    if method == KTO:
        return RowBatch(items, [it.chosen for it in items], mismatched(items, context + 1))
    return RowBatch(items, [s for it in items for s in (it.chosen, it.rejected)], [])


class LogProbs:
    """Policy and reference log-probabilities of row batches, for one run."""

    def __init__(self, model, session: TrainSession, config: PreferenceConfig, ref_adapter):
        self.model, self.session, self.config = model, session, config
        self.ref_params = (model.params(ref_adapter, training=True)
                           if config.method in USES_REFERENCE else None)
        if self.ref_params is not None:   # each product as the policy's (bf16 or fp32)
            policy = session.eval_params
            self.ref_params.precision = policy.precision
            self.ref_params.float32_names = frozenset(
                name for name in policy.full if not policy.computes_in_bf16(name))

    def __call__(self, seqs: Seq[Sequence], reference: bool) -> np.ndarray:
        c = self.config
        params = self.ref_params if reference else self.session.eval_params
        return sequence_log_probs(self.model, params, seqs, c.micro_batch_tokens,
                                  c.train.vocab_chunk)


def batch_loss(config: PreferenceConfig, rb: RowBatch, logps: LogProbs,
               pairs_of_rows: bool = False) -> losses.LossOutput:
    """The loss of a row batch (dL/dlogp per sequence of rb.seqs) with TRL's metrics.
    pairs_of_rows: KTO rows 2i and 2i+1 are a pair's chosen and rejected (held-out accuracy
    compares their rewards)."""
    m, beta = config.method, config.effective_beta
    pol = logps(rb.seqs, False)
    n = completion_tokens(rb.seqs)
    if m == KTO:
        ref = logps(rb.seqs, True)
        kl = losses.kto_kl(logps(rb.kl_seqs, False), logps(rb.kl_seqs, True))
        out = losses.kto_loss(pol, ref, [it.label for it in rb.items], kl, beta=beta,
                              desirable_weight=config.kto_desirable_weight,
                              undesirable_weight=config.kto_undesirable_weight)
        if pairs_of_rows:
            r = beta * (pol - ref)
            out.metrics["rewards/accuracies"] = float((r[0::2] > r[1::2]).mean())
        return out
    pc, pr, nc, nr = pol[0::2], pol[1::2], n[0::2], n[1::2]
    if m == "dpo":
        ref = logps(rb.seqs, True)
        return losses.dpo_loss(pc, pr, ref[0::2], ref[1::2], nc, nr, beta=beta,
                               loss_type=config.pref_loss,
                               label_smoothing=config.label_smoothing,
                               sft_weight=config.sft_weight)
    if m == "orpo":
        return losses.orpo_loss(pc, pr, nc, nr, orpo_lambda=config.orpo_lambda)
    return losses.simpo_loss(pc, pr, nc, nr, beta=beta, gamma=config.simpo_gamma,
                             label_smoothing=config.label_smoothing,
                             sft_weight=config.sft_weight)


def sequence_grads(out: losses.LossOutput) -> np.ndarray:
    """dL/dlogp of every sequence in rb.seqs order."""
    if out.d_rejected is None:
        return out.d_chosen
    d = np.empty(2 * len(out.d_chosen))
    d[0::2], d[1::2] = out.d_chosen, out.d_rejected
    return d


def weighted_batches(seqs: Seq[Sequence], d: np.ndarray, max_tokens: int) -> list[Batch]:
    """The micro-batches whose weighted cross-entropy step has the gradient sum_s d_s grad
    logp_s: token weights -d_s x N (the session divides by the N target tokens)."""
    total = float(completion_tokens(seqs).sum())
    return pack(seqs, -np.asarray(d) * total, max_tokens)[0]


# ---- data -------------------------------------------------------------------------------------------

def load_rows(config: PreferenceConfig, tokenizer, report: Report, should_stop):
    """(training rows, held-out rows, the file's PreferenceData, is the held-out paired KTO)."""
    def load(path, ask):
        return load_preferences(path, tokenizer, context=config.context,
                                chat_template=config.chat_template,
                                completion_as_chat=config.completion_as_chat,
                                stop=StopCheck(ask, f"reading {Path(path).name}"))
    data, stopped = before_training(lambda ask: load(config.data, ask), should_stop)
    if stopped:
        return None, stopped
    if data.rejections.total:
        report(events.LOG_EVENT(message=data.rejections.summary()))
    if config.val_data:
        val_data, stopped = before_training(lambda ask: load(config.val_data, ask), should_stop)
        if stopped:
            return None, stopped
        train_items, val_items, val_paired = data.items, val_data.items, val_data.paired
    else:
        train_items, val_items = data.split(config.val_split, config.train.seed)
        val_paired = data.paired
    if config.method == KTO:
        train_items, val_items = unpaired(train_items), unpaired(val_items)
    else:
        for path, paired in ((config.data, data.paired), (config.val_data, val_paired)):
            if not paired:
                raise DatasetError(f"{Path(path).name} has unpaired (KTO) rows: "
                                   f"{config.method.upper()} needs chosen/rejected pairs.",
                                   "Train it with --method kto, or use a file of pairs.")
    if not train_items:
        raise DatasetError(f"{Path(config.data).name} has no usable preference rows "
                           f"({data.rejections.total} of {data.n_rows} rejected).",
                           "Run `workbench lint` on it to see why.")
    return (train_items, val_items, data, val_paired and config.method == KTO), None


# ---- the run ----------------------------------------------------------------------------------------

def _prefixed(metrics: dict, prefix: str = "eval_") -> dict:
    return {prefix + k: v for k, v in metrics.items()}


def train_preference(config: PreferenceConfig, report: Report, should_stop: ShouldStop,
                     checkpoints: str | Path | None = None,
                     allow_changed_inputs: bool = False) -> str:
    """Run (or resume, from the newest checkpoint in `checkpoints`) a preference run.
    Returns "done", "paused" or "cancelled" (events: module docstring)."""
    config.validate()
    t_start = time.perf_counter()
    inputs = fingerprints.check_inputs(
        checkpoints, {"model": config.model, "dataset": config.data,
                      "validation data": config.val_data, "adapter": config.adapter},
        report, allow_changed_inputs)
    check_run_memory(config.model, config.train, config.micro_batch_tokens)
    model = load_model(config.model,
                       run_cache_budget(config.model, config.train, config.micro_batch_tokens),
                       config.train.device)
    report(events.LOG_EVENT(message=f"tokenizing {Path(config.data).name}"))
    loaded, stopped = load_rows(config, model.tokenizer, report, should_stop)
    if stopped:
        return stopped
    train_items, val_items, data, val_pairs_of_rows = loaded
    method, P = config.method, config.pairs_per_step
    steps_per_epoch = math.ceil(len(train_items) / P)
    total = config.epochs * steps_per_epoch if config.epochs else config.max_steps
    if config.max_steps:
        total = min(total, config.max_steps)
    adapter = load_adapter(config.adapter) if config.adapter else None
    session = TrainSession(model, config.train.for_steps(total), adapter)
    ref_adapter = load_adapter(config.adapter) if config.adapter else None  # stays as loaded
    logps = LogProbs(model, session, config, ref_adapter)
    state = {"bad_streak": 0, "skipped_steps": 0, "last_eval_step": -1,
             "best_accuracy": -math.inf, "best_margin": -math.inf, "best_step": 0}
    ckpt_dir = resume(session, checkpoints, state, report)
    state[fingerprints.STATE_KEY] = inputs
    seed = config.train.seed
    reference = ("none" if method not in USES_REFERENCE else
                 "the starting adapter" if config.adapter else
                 "the base (adapter off)" if session.adapter is not None else "the model file")
    report(SCHEMAS[method][events.START](
        total_steps=total, epochs=math.ceil(total / steps_per_epoch), trainable=session.n_trainable,
        train_rows=len(train_items), val_rows=len(val_items),
        skipped_rows=data.rejections.total, pairs_per_step=P, method=method,
        loss_type=config.pref_loss if method == "dpo" else method,
        beta=config.effective_beta, reference=reference, resumed_at=session.step_count))

    save = checkpoint_saver(ckpt_dir, session, state, config.keep_last, report)

    def evaluate() -> None:
        if not val_items:
            return
        t0 = time.perf_counter()
        out = batch_loss(config, row_batch(val_items, method, config.context), logps,
                         val_pairs_of_rows)
        state["last_eval_step"] = session.step_count
        acc, margin = out.metrics["rewards/accuracies"], out.metrics["rewards/margins"]
        margin = -math.inf if margin is None else margin   # KTO rows of one label only
        better = session.step_count > 0 and (acc, margin) > (state["best_accuracy"],
                                                               state["best_margin"])
        if better:
            state.update(best_accuracy=acc, best_margin=margin, best_step=session.step_count)
        report(SCHEMAS[method][events.EVAL](
            step=session.step_count, rows=len(val_items), best=better,
            eval_s=time.perf_counter() - t0, **_prefixed(out.metrics)))
        if better:
            save("best")

    if session.step_count == 0:
        evaluate()
    routing_window: dict = {}
    stop_reason = None
    session_start, t_loop = session.step_count, time.perf_counter()
    while session.step_count < total and stop_reason is None:
        step = session.step_count
        picked = [train_items[i] for i in step_prompts(len(train_items), step, P, seed)]
        rb = row_batch(picked, method, config.context)
        out = batch_loss(config, rb, logps)
        batches = weighted_batches(rb.seqs, sequence_grads(out), config.micro_batch_tokens)
        metrics, bad = guarded_step(
            session, batches, state, config.max_bad_steps,
            oom_hint="Lower pairs_per_step or micro_batch_tokens, or the LoRA rank.",
            diverged_hint="Lower the learning rate or beta, or set max_grad_norm / gclip.")
        for layer, counts in metrics.routing.items():
            routing_window[layer] = routing_window.get(layer, 0) + counts
        done_steps = session.step_count - session_start
        elapsed = time.perf_counter() - t_loop
        eta = elapsed / done_steps * (total - session.step_count) if done_steps else 0.0
        m = out.metrics
        report(SCHEMAS[method][events.STEP](
            step=session.step_count, total_steps=total, epoch=step * P // len(train_items) + 1,
            epochs=math.ceil(total / steps_per_epoch), loss=m["loss"],
            accuracy=m["rewards/accuracies"], lr=metrics.lr, grad_norm=metrics.grad_norm,
            clipped_fraction=metrics.clipped_fraction, tokens=metrics.tokens,
            tokens_per_s=metrics.tokens_per_s, skipped=bad,
            elapsed_s=time.perf_counter() - t_start, eta_s=eta, rss_mb=peak_rss_mb(),
            rows=len(picked), **{k: v for k, v in m.items() if k != "loss"}))
        routing_window, stop_reason = between_steps(config, session, report, routing_window,
                                                    evaluate, save, should_stop)
    stopped = finish_run(stop_reason, state, session, ckpt_dir, evaluate, save)
    if stopped:
        return stopped
    report(SCHEMAS[method][events.DONE](
        step=session.step_count, reason="finished", best_step=state["best_step"],
        best_accuracy=state["best_accuracy"] if math.isfinite(state["best_accuracy"]) else None,
        skipped_steps=state["skipped_steps"], elapsed_s=time.perf_counter() - t_start))
    return "done"


def run_preference_job(run_dir, control) -> str:
    """The worker's runner for a preference run directory (config.json "kind": dpo, orpo,
    simpo or kto): train its config, resuming from its checkpoints."""
    config = PreferenceConfig.from_dict(run_dir.config())
    return train_preference(config, control.report, control.should_stop,
                            run_dir.checkpoints_dir)
