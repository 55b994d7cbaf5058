"""GRPO-style runs: sample completions, score them with reward functions, reward-weighted SFT.

Each step takes P prompts (`prompts_per_step`) from the prompt file, samples G completions of
each (`group_size`) with the current LoRA adapter (temperature, top-p, `max_new_tokens`; chat
rows get the model's chat template and the generation prompt, plain rows are tokenized as they
are), scores them with the weighted sum of the reward functions (app.engine.training.reward_functions),
computes advantages and takes ONE optimizer step of reward-weighted SFT on the completions:
prompt tokens are labelled -1 (not trained); every completion token, the end-of-turn token that
ended it included, carries its sequence's advantage as its token weight. The SFT loss is
sum_t w_t CE_t / N with N the number of completion tokens of the step, so its gradient is

    grad L = -(1/N) sum_i A_i sum_t grad log pi(o_it | prompt_i, o_i<t)

which is exactly the GRPO policy gradient for one update per batch (the importance ratio is 1
and the clipped surrogate's gradient equals it) without a KL term, with DAPO's token-level
normalisation (tests/engine/test_grpo.py checks it against finite differences). Keep LoRA
dropout at 0 (the default): with dropout the policy trained is not the one that sampled.

Advantages (`advantage`), per group of G completions of one prompt:
* "group-std" (default): (r - mean_group) / (std_group + 1e-6), std with ddof 0;
* "no-std": r - mean_group (Dr. GRPO);
* "batch-std": (r - mean_group) / (std_batch + 1e-6), the std of all P*G rewards of the step.
A group whose rewards are all equal ("zero spread") gets advantage exactly 0: it teaches nothing
and its completions are left out of the backward pass; the weights of the others are rescaled
by N_kept / N so the gradient is unchanged (N still counts every completion token).

KL penalty (`kl` = beta > 0) against the base model (adapter off), with the k3 estimator
k3_t = exp(r_t) - r_t - 1, r_t = log pi_ref(o_t) - log pi(o_t), whose gradient is
(1 - exp(r_t)) grad log pi(o_t). Minimising -(1/N) sum A_i log pi + (beta/N) sum_t k3_t is then a
weighted SFT step with per-token weights, constants at the current parameters:

    w_t = A_i - beta * (1 - exp(log pi_ref(o_t) - log pi(o_t)))

(both log-probabilities from `Model.logits`, one extra forward pass each per completion).

Sampling is seeded by (seed, step, prompt row, sample), the prompt order by (seed, epoch), so a
run paused and resumed from a checkpoint samples, scores and trains exactly as an uninterrupted
one.

Events (`report`, appended to metrics.jsonl by the worker and the CLI; built with the schemas of
app.engine.training.events; the GRPO-specific ones carry "kind": "grpo"; times in seconds, lengths
in generated tokens with the end-of-turn token):
* start:   total_steps, epochs, trainable, prompt_rows, train_prompts, val_prompts,
           skipped_rows, group_size, prompts_per_step, advantage, kl,
           rewards [{name, kind, weight}], resumed_at
* step:    step, total_steps, epoch, epochs, loss (the weighted SFT loss, ~0 on average),
           accuracy, lr, grad_norm, clipped_fraction, tokens, tokens_per_s, skipped,
           reward_mean, reward_std (weighted total), rewards {name: {mean, std}} (raw values),
           zero_spread_fraction (groups whose rewards are all equal), completion_len_mean /
           _min / _max, completion_clipped_fraction (no end-of-turn within max_new_tokens),
           advantage_mean, advantage_std, advantage_abs_mean, kl (mean k3 per token, null
           without a KL penalty), sample_s, reward_s, update_s, step_s, sample_tokens_per_s,
           elapsed_s, eta_s, rss_mb
* samples: step, items [{prompt_index, line, sample, prompt, answer, completion, reward,
           rewards {name: value}, advantage, length, finished}]: every `samples_every` steps,
           all G completions of the step's first `samples_prompts` prompts
* eval:    step, prompts, reward_mean, reward_std, rewards {name: {mean, std}},
           completion_len_mean, completion_clipped_fraction, examples [3 items as in samples,
           advantage null], eval_s: greedy completions of the held-out prompts, at step 0, every
           `eval_every` steps and at the end; with `eval_samples` k > 0 also
           sampled {samples, temperature, reward_mean, reward_std, rewards}: k completions per
           held-out prompt at the run's temperature, seeded alike at every evaluation
* norms, routing, checkpoint, log: as in app.engine.training.sft; done: step, reason, skipped_steps,
  elapsed_s
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, Sequence

import numpy as np

from app.engine.data.batches import Batch
from app.engine.data.formats import Rejection, iter_lines, parse_line
from app.engine.errors import ConfigError, DatasetError
from app.engine.model.lora import load_adapter
from app.engine.model.transformer import Model, load_model
from app.engine.runtime.backend import peak_rss_mb
from app.engine.runtime.inputs import StopCheck
from app.engine.text.chat_template import generation_prompt_ids
from app.engine.training import events, fingerprints
from app.engine.training.config import TrainConfig
from app.engine.training.memory import check_run_memory, run_cache_budget
from app.engine.runtime.schema import AT_LEAST_0, AT_LEAST_1, FRACTION, POSITIVE, TEXT, Range, check
from app.engine.training.reward_functions import (RewardScorer, RewardSpec, ScoreItem,
                                                  check_reward_trust)
from app.engine.training.session import TrainSession
from app.engine.training.sft import (RUN_LENGTHS, before_training, between_steps,
                                    checkpoint_saver, finish_run, guarded_step, resume)

Report = Callable[[dict], None]
ShouldStop = Callable[[], "str | None"]

KIND = events.GRPO_RUN
ADVANTAGES = ("group-std", "no-std", "batch-std")
STD_EPS = 1e-6


# ---- configuration --------------------------------------------------------------------------------

GRPO_LR = 1e-4   # GRPO's own default learning rate (TrainConfig's is swept for supervised runs)
# The most completions per prompt, and prompts per step (the window's ranges): a step samples
# their product at once (a KV cache per sequence), and a billion of either was a list of a
# billion items built before any check, deaf to SIGTERM. The memory of the product is checked
# before a run starts (app.engine.training.memory.check_run_memory).
MAX_GROUP, MAX_PROMPTS_PER_STEP = 1024, 4096

@dataclass(frozen=True)
class GrpoConfig:
    """One GRPO run, completely (saved as the run directory's config.json with "kind": "grpo").

    train: the usual training options (LoRA rank/alpha/targets, optimizer, lr, schedule, seed,
    ...); train.max_steps is derived from max_steps. Only LoRA runs (mode "lora"): sampling
    uses the adapter. The seed (train.seed) drives sampling, prompt order and the held-out split.
    """

    model: str
    prompts: str
    rewards: tuple[RewardSpec, ...] = (RewardSpec("exact"),)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=GRPO_LR))
    group_size: int = 8              # G completions per prompt
    prompts_per_step: int = 4        # P prompts per step
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64         # generated tokens per completion, end-of-turn included
    advantage: str = "group-std"     # group-std | no-std | batch-std
    kl: float = 0.0                  # beta of the k3 KL penalty against the base model
    max_steps: int = 100
    val_split: float = 0.0           # fraction of prompt rows held out for greedy evaluation
    eval_every: int = 0              # steps between evaluations (0: at the start and the end)
    eval_samples: int = 0            # also sample this many completions per held-out prompt
    samples_every: int = 10          # steps between "samples" events (0: never)
    samples_prompts: int = 2         # prompt groups shown in a samples event
    save_every: int = 25             # steps between checkpoints (0: only at pause and end)
    keep_last: int = 2
    norms_every: int = 10            # steps between LoRA-norm and routing events (0: never)
    max_bad_steps: int = 5           # consecutive NaN/Inf steps before the run stops
    reward_timeout: float = 10.0     # seconds per call of a custom reward function
    answer_field: str = "answer"     # the row field exact/numeric rewards compare with
    parse_special: bool = False      # plain prompts: special-token texts become their tokens
    micro_batch_tokens: int = 2048   # tokens per micro-batch of the update (same gradient)
    adapter: str | None = None       # start from an existing GGUF LoRA adapter

    SCHEMA_RULES: ClassVar[dict] = dict(
        kind=(KIND,), model=TEXT, prompts=TEXT, group_size=Range(2, MAX_GROUP),
        prompts_per_step=Range(1, MAX_PROMPTS_PER_STEP),
        temperature=AT_LEAST_0, top_p=Range(0, 1, lo_open=True), max_new_tokens=AT_LEAST_1,
        advantage=ADVANTAGES, kl=AT_LEAST_0, max_steps=AT_LEAST_1, val_split=FRACTION,
        eval_samples=Range(0, MAX_GROUP), samples_every=AT_LEAST_0, samples_prompts=AT_LEAST_0,
        reward_timeout=POSITIVE, answer_field=TEXT, micro_batch_tokens=AT_LEAST_1,
        **RUN_LENGTHS)

    def validate(self) -> None:
        self.train.validate()
        if self.train.mode != "lora":
            raise ConfigError("GRPO runs train LoRA adapters (mode lora).",
                              "Sampling uses the adapter; full and hybrid fine-tuning are not "
                              "supported for GRPO yet.")
        if not self.rewards:
            raise ConfigError("A GRPO run needs at least one reward function.",
                              "Add --reward exact (or regex:..., a .py file, ...).")
        for spec in self.rewards:
            spec.validate()
        if self.advantage not in ADVANTAGES:
            raise ConfigError(f"Unknown advantage normalisation '{self.advantage}'.",
                              "Use one of: " + ", ".join(ADVANTAGES) + ".")
        for name in ("group_size", "prompts_per_step", "max_new_tokens", "max_steps",
                     "keep_last", "max_bad_steps", "micro_batch_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1.")
        if self.group_size < 2:
            raise ConfigError("group_size must be at least 2: advantages compare completions "
                              "of the same prompt.")
        for name in ("eval_every", "eval_samples", "samples_every", "samples_prompts",
                     "save_every", "norms_every", "kl", "temperature"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative.")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.val_split < 1.0:
            raise ConfigError(f"val_split must be in [0, 1), got {self.val_split}.")
        if not self.reward_timeout > 0:
            raise ConfigError("reward_timeout must be positive.")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d = {"kind": KIND, **d}
        d["train"] = {k: list(v) if isinstance(v, tuple) else v for k, v in d["train"].items()}
        d["rewards"] = [s.to_dict() for s in self.rewards]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "GrpoConfig":
        d = dict(d)
        kind = d.pop("kind", KIND)
        if kind != KIND:
            raise ConfigError(f"This is a '{kind}' run configuration, not a GRPO one.")
        check(d, cls)       # every unknown key, wrong type or value out of range
        train = TrainConfig.from_dict({"lr": GRPO_LR, **d.pop("train", {})})
        rewards = tuple(RewardSpec.from_dict(r) for r in d.pop("rewards", [{"kind": "exact"}]))
        return cls(train=train, rewards=rewards, **d)


def build_grpo_config(d: dict) -> GrpoConfig:
    """The validated GrpoConfig a new run starts from: `d` is a GrpoConfig dict gathered by the
    CLI (options over a config file) or the window (its forms). The model, prompt, adapter and
    custom reward file paths are made absolute (the worker runs elsewhere); a missing model,
    prompt file or reward is a ConfigError."""
    d = dict(d)
    if not d.get("model") or not d.get("prompts"):
        raise ConfigError("A GRPO run needs a model and a prompt file.",
                          "Pass --model and --prompts (in the window: the Model and Prompts "
                          "tabs).")
    if not d.get("rewards"):
        raise ConfigError("A GRPO run needs at least one reward function.",
                          "Add a reward: exact (or regex:PATTERN, numeric, a .py file, ...).")
    check(d, GrpoConfig)
    absolute = lambda p: str(Path(p).expanduser().resolve())
    for key in ("model", "prompts", "adapter"):
        if d.get(key):
            d[key] = absolute(d[key])
    d["rewards"] = [{**r, "arg": absolute(r["arg"])} if r.get("kind") == "file" and r.get("arg")
                    else r for r in d["rewards"]]
    config = GrpoConfig.from_dict(d)
    config.validate()
    return config


# ---- prompts ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PromptRow:
    """A usable prompt row: its index among the file's rows, its line, its token ids, the prompt
    text as written (for rewards and display) and all of its fields."""

    index: int
    line: int
    ids: tuple[int, ...]
    text: str
    row: dict


def prompt_ids(tokenizer, row: dict, parse_special: bool = False) -> tuple[list[int], str]:
    """(token ids, prompt text) of a prompt row: `messages` (or a list `prompt`) rendered with the
    model's chat template plus the generation prompt, or a plain `prompt` string, with BOS and
    without EOS as `generation_prompt_ids` says."""
    messages = row.get("messages")
    if messages is None and isinstance(row.get("prompt"), list):
        messages = row["prompt"]
    if messages is not None:
        if (not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages)):
            raise ValueError('"messages" must be a non-empty list of {"role", "content"} '
                             "objects with string values")
        return generation_prompt_ids(tokenizer, messages), messages[-1]["content"]
    if isinstance(row.get("prompt"), str):
        return generation_prompt_ids(tokenizer, row["prompt"], parse_special), row["prompt"]
    raise ValueError('a prompt row needs "messages" (chat) or "prompt" (text)')


def load_prompts(path: str, tokenizer, scorer: RewardScorer, max_prompt_tokens: int,
                 parse_special: bool = False,
                 should_stop=None) -> tuple[list[PromptRow], list[Rejection], int]:
    """(usable rows, rejections, number of rows) of a prompt JSONL file (a regular file: else
    DatasetError; `should_stop`: see `StopCheck`)."""
    rows, rejected, n = [], [], 0
    stop = StopCheck(should_stop, f"reading {Path(path).name}")
    for index, (line, raw) in enumerate(iter_lines(path, what="prompts file", stop=stop)):
        n += 1
        obj = parse_line(line, raw)
        if isinstance(obj, Rejection):
            rejected.append(obj)
            continue
        try:
            ids, shown = prompt_ids(tokenizer, obj, parse_special)
        except (ValueError, ConfigError) as e:
            rejected.append(Rejection(line, "prompt", str(e)))
            continue
        problem = scorer.check_row(obj)
        if problem is None and len(ids) > max_prompt_tokens:
            problem = (f"the prompt has {len(ids)} tokens; with max_new_tokens the context allows "
                       f"at most {max_prompt_tokens}")
        if problem is not None:
            rejected.append(Rejection(line, "prompt", problem))
            continue
        rows.append(PromptRow(index, line, tuple(ids), shown, obj))
    return rows, rejected, n


def split_prompts(rows: list[PromptRow], val_split: float, seed: int):
    """(train rows, held-out rows): a seeded random `val_split` fraction is held out."""
    if val_split <= 0 or len(rows) < 2:
        return rows, []
    n_val = min(max(1, round(val_split * len(rows))), len(rows) - 1)
    order = np.random.default_rng([seed, 0x5EED]).permutation(len(rows))
    held = set(order[:n_val].tolist())
    return ([r for i, r in enumerate(rows) if i not in held],
            [r for i, r in enumerate(rows) if i in held])


def step_prompts(n_rows: int, step: int, per_step: int, seed: int) -> list[int]:
    """Indices (into the training rows) of the prompts of `step` (0-based): consecutive slices
    of one seeded permutation per epoch (pass over the rows)."""
    out = []
    for k in range(step * per_step, (step + 1) * per_step):
        epoch, pos = divmod(k, n_rows)
        out.append(int(np.random.default_rng([seed, epoch]).permutation(n_rows)[pos]))
    return out


# ---- sampling -----------------------------------------------------------------------------------

def sample_seed(seed: int, step: int, row: int, sample: int) -> int:
    """The sampling seed of one completion, from (run seed, step, prompt row, sample)."""
    return int(np.random.SeedSequence([seed, step, row, sample]).generate_state(1, np.uint64)[0])


@dataclass
class Completion:
    prompt: PromptRow
    sample: int
    ids: list[int]            # generated ids, the end-of-turn token included when finished
    finished: bool
    text: str                 # decoded, without the end-of-turn token


def sample_groups(model: Model, rows: Sequence[PromptRow], group_size: int, adapter,
                  config: GrpoConfig, step: int, seed: int,
                  temperature: float | None = None) -> list[Completion]:
    """G completions per row, in order (row-major), seeded by sample_seed. A completion ends at
    an end-of-turn token, kept as its last id (finished), or after max_new_tokens ids (clipped).
    Decoded together (Model.generate_batch) in batches of at most a training step's
    prompts_per_step * group_size sequences, which bounds the KV cache."""
    tok = model.tokenizer
    stop_ids = frozenset(tok.eot_ids)
    temp = config.temperature if temperature is None else temperature
    todo = [(row, j) for row in rows for j in range(group_size)]
    size = config.prompts_per_step * config.group_size
    out = []
    for start in range(0, len(todo), size):
        batch = todo[start:start + size]
        generated = model.generate_batch(
            [row.ids for row, _ in batch], config.max_new_tokens, temp, config.top_p,
            [sample_seed(seed, step, row.index, j) for row, j in batch], adapter, stop=stop_ids,
            llamacpp_numerics=False)     # sample from the float32 numerics that are trained
        for (row, j), ids in zip(batch, generated):
            finished = bool(ids) and ids[-1] in stop_ids
            out.append(Completion(row, j, ids, finished, tok.decode(ids[:-1] if finished else ids)))
    return out


# ---- advantages and the update ---------------------------------------------------------------------

def compute_advantages(rewards: np.ndarray, mode: str = "group-std") -> np.ndarray:
    """Advantages (P, G) of rewards (P, G), float64. Groups with zero spread get exactly 0."""
    r = np.asarray(rewards, np.float64)
    if r.ndim != 2:
        raise ValueError(f"rewards must be (P, G), got shape {r.shape}")
    if mode not in ADVANTAGES:
        raise ConfigError(f"Unknown advantage normalisation '{mode}'.")
    centred = r - r.mean(axis=1, keepdims=True)                           # (P, G)
    flat = np.ptp(r, axis=1) == 0                                         # (P,) zero spread
    centred[flat] = 0.0
    if mode == "group-std":
        adv = centred / (r.std(axis=1, keepdims=True) + STD_EPS)
    elif mode == "batch-std":
        adv = centred / (r.std() + STD_EPS)
    else:
        adv = centred
    adv[flat] = 0.0
    return adv


def token_log_probs(model: Model, prompt: Sequence[int], completion: Sequence[int],
                    adapter=None) -> np.ndarray:
    """log pi(o_t | prompt, o_<t) of each completion token (float64), from `Model.logits`."""
    seq = np.asarray(list(prompt) + list(completion), np.int64)
    logits = model.logits(seq[:-1], adapter,
                          llamacpp_numerics=False).astype(np.float64)     # (T-1, V) as trained
    z = logits[len(prompt) - 1:]                                          # (n, V)
    m = z.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True)))[:, 0]    # (n,)
    return z[np.arange(len(completion)), np.asarray(completion)] - lse


def kl_weights(advantage: float, logp: np.ndarray, ref_logp: np.ndarray,
               beta: float) -> tuple[np.ndarray, np.ndarray]:
    """(per-token weights A - beta (1 - exp(ref - logp)), per-token k3 KL estimates)."""
    r = np.asarray(ref_logp, np.float64) - np.asarray(logp, np.float64)
    k3 = np.expm1(r) - r
    return advantage - beta * (-np.expm1(r)), k3


def policy_batches(sequences: Sequence[tuple[Sequence[int], Sequence[int], np.ndarray]],
                   max_tokens: int = 2048) -> list[Batch]:
    """Micro-batches for the reward-weighted SFT step.

    sequences: (prompt ids, completion ids, per-completion-token weights). Each becomes tokens
    prompt+completion[:-1], labels -1 on the prompt and the completion ids after it, token
    weights on the completion. Sequences whose weights are all 0 are left out and the others'
    weights scaled by N_kept / N (N = all completion tokens) so that the summed loss
    sum_t w_t CE_t / N, and its gradient, are unchanged (if nothing is left, one zero-weight
    sequence stays so the step sees a zero gradient). Packed greedily into micro-batches of at
    most `max_tokens` tokens (a longer sequence gets one of its own); the trainer averages
    micro-batches by their token counts, which gives the same gradient as one batch.
    """
    n_all = sum(len(c) for _, c, _ in sequences)
    kept = [s for s in sequences if np.any(np.asarray(s[2]) != 0)]
    if not kept:
        kept = [(sequences[0][0], sequences[0][1], np.zeros(len(sequences[0][1])))]
    n_kept = sum(len(c) for _, c, _ in kept)
    scale = n_kept / n_all
    batches, current, size = [], [], 0
    for prompt, completion, weights in kept:
        length = len(prompt) + len(completion) - 1
        if current and size + length > max_tokens:
            batches.append(_pack(current))
            current, size = [], 0
        current.append((prompt, completion, np.asarray(weights, np.float64) * scale))
        size += length
    if current:
        batches.append(_pack(current))
    return batches


def _pack(items) -> Batch:
    tokens, labels, weights, positions, segments = [], [], [], [], []
    for k, (prompt, completion, w) in enumerate(items):
        seq = np.asarray(list(prompt) + list(completion), np.int64)
        lab = seq[1:].copy()
        lab[:len(prompt) - 1] = -1
        tw = np.zeros(len(seq) - 1, np.float32)
        tw[len(prompt) - 1:] = w
        tokens.append(seq[:-1])
        labels.append(lab)
        weights.append(tw)
        positions.append(np.arange(len(seq) - 1))
        segments.append(np.full(len(seq) - 1, k))
    return Batch(np.concatenate(tokens), np.concatenate(labels), np.concatenate(weights),
                 np.concatenate(positions), np.concatenate(segments))


# ---- the run ----------------------------------------------------------------------------------------

def _stats(values) -> tuple[float, float]:
    v = np.asarray(values, np.float64)
    return (float(v.mean()), float(v.std())) if v.size else (math.nan, math.nan)


def _score(scorer: RewardScorer, completions: Sequence[Completion], max_new_tokens: int):
    items = [ScoreItem(c.prompt.text, c.text, c.prompt.row, c.prompt.index, c.prompt.line,
                       len(c.ids), max_new_tokens) for c in completions]
    raw = scorer.score(items)                                             # (n, K)
    return raw, raw @ scorer.weights                                      # (n,)


def _sample_items(completions, raw, total, adv, names, answer_field) -> list[dict]:
    return [{"prompt_index": c.prompt.index, "line": c.prompt.line, "sample": c.sample,
             "prompt": c.prompt.text, "answer": c.prompt.row.get(answer_field),
             "completion": c.text, "reward": float(total[i]),
             "rewards": {n: float(raw[i, k]) for k, n in enumerate(names)},
             "advantage": None if adv is None else float(adv[i]),
             "length": len(c.ids), "finished": c.finished}
            for i, c in enumerate(completions)]


def check_grpo_memory(config: GrpoConfig) -> None:
    """OutOfMemoryError naming the size when the run cannot fit this machine's (or GPU's)
    memory: its training estimate plus the KV cache of a step's completions, sampled at once."""
    check_run_memory(config.model, config.train, config.micro_batch_tokens,
                     config.prompts_per_step * config.group_size, config.max_new_tokens)


def train_grpo(config: GrpoConfig, report: Report, should_stop: ShouldStop,
               checkpoints: str | Path | None = None, allow_changed_inputs: bool = False) -> str:
    """Run (or resume, from the newest checkpoint in `checkpoints`) a GRPO run.

    Returns "done", "paused" or "cancelled". Events: log, start, eval, step, samples, norms,
    routing, checkpoint, done (formats in the module docstring). Raises EngineError subclasses
    for bad input (RewardError when a reward function fails; InputChanged when a resumed run's
    model or prompts changed, unless `allow_changed_inputs`: app.engine.training.fingerprints)
    and TrainingDiverged after `max_bad_steps` consecutive non-finite steps.
    """
    config.validate()
    t_start = time.perf_counter()
    inputs = fingerprints.check_inputs(
        checkpoints, {"model": config.model, "prompts": config.prompts, "adapter": config.adapter},
        report, allow_changed_inputs)
    check_grpo_memory(config)   # wherever it runs (a queue's worker, the window): this machine
    model = load_model(config.model,
                       run_cache_budget(config.model, config.train, config.micro_batch_tokens),
                       config.train.device)
    tok = model.tokenizer
    seed = config.train.seed
    total = config.max_steps
    with RewardScorer(config.rewards, config.answer_field, config.reward_timeout,
                      Path(config.prompts).name) as scorer:
        max_prompt = model.config.context_length - config.max_new_tokens
        loaded, stopped = before_training(
            lambda ask: load_prompts(config.prompts, tok, scorer, max_prompt,
                                     config.parse_special, ask), should_stop)
        if stopped:
            return stopped
        rows, rejected, n_rows = loaded
        for r in rejected[:5]:
            report(events.LOG_EVENT(message=f"skipped line {r.line}: {r.reason}"))
        train_rows, val_rows = split_prompts(rows, config.val_split, seed)
        if not train_rows:
            raise DatasetError(f"{Path(config.prompts).name} has no usable prompt rows "
                               f"({len(rejected)} of {n_rows} rejected).",
                               'Rows need "messages" or "prompt", and the reference field the '
                               "rewards use.")
        adapter = load_adapter(config.adapter) if config.adapter else None
        session = TrainSession(model, config.train.for_steps(total), adapter)
        state = {"bad_streak": 0, "skipped_steps": 0, "last_eval_step": -1,
                 "best_reward": -math.inf, "best_step": 0}
        ckpt_dir = resume(session, checkpoints, state, report)
        state[fingerprints.STATE_KEY] = inputs     # what the checkpoints from now on record
        names = list(scorer.names)
        per_epoch = len(train_rows) / config.prompts_per_step
        report(events.GRPO_START(
            total_steps=total, trainable=session.n_trainable, prompt_rows=n_rows,
            train_prompts=len(train_rows), val_prompts=len(val_rows), skipped_rows=len(rejected),
            group_size=config.group_size, prompts_per_step=config.prompts_per_step,
            advantage=config.advantage, kl=config.kl, epochs=math.ceil(total / per_epoch),
            rewards=[{"name": n, "kind": s.kind, "weight": s.weight}
                     for n, s in zip(names, config.rewards)],
            resumed_at=session.step_count, precision=session.precision.reason))

        save = checkpoint_saver(ckpt_dir, session, state, config.keep_last, report)

        def evaluate() -> None:
            if not val_rows:
                return
            t0 = time.perf_counter()
            done = sample_groups(model, val_rows, 1, session.adapter, config, 0, seed, 0.0)
            raw, total_r = _score(scorer, done, config.max_new_tokens)
            lengths = [len(c.ids) for c in done]
            state["last_eval_step"] = session.step_count
            sampled = {}
            if config.eval_samples:     # the same seeds at every evaluation: comparable
                s_done = sample_groups(model, val_rows, config.eval_samples, session.adapter,
                                       config, 0, seed)
                s_raw, s_total = _score(scorer, s_done, config.max_new_tokens)
                sampled["sampled"] = {"samples": config.eval_samples,
                                      "temperature": config.temperature,
                                      "reward_mean": float(s_total.mean()),
                                      "reward_std": float(s_total.std()),
                                      "rewards": {n: dict(zip(("mean", "std"), _stats(s_raw[:, k])))
                                                  for k, n in enumerate(names)}}
            report(events.GRPO_EVAL(
                step=session.step_count, prompts=len(done), reward_mean=float(total_r.mean()),
                reward_std=float(total_r.std()),
                rewards={n: dict(zip(("mean", "std"), _stats(raw[:, k])))
                         for k, n in enumerate(names)},
                completion_len_mean=float(np.mean(lengths)),
                completion_clipped_fraction=float(np.mean([not c.finished for c in done])),
                examples=_sample_items(done[:3], raw, total_r, None, names, config.answer_field),
                eval_s=time.perf_counter() - t0, **sampled))
            # the best trained adapter is kept (the base model's evaluation, step 0, has none)
            if session.step_count and float(total_r.mean()) > state["best_reward"]:
                state.update(best_reward=float(total_r.mean()), best_step=session.step_count)
                save("best")

        if session.step_count == 0:
            evaluate()
        routing_window: dict[int, np.ndarray] = {}
        stop_reason = None
        session_start, t_loop = session.step_count, time.perf_counter()
        P, G = config.prompts_per_step, config.group_size
        while session.step_count < total and stop_reason is None:
            step = session.step_count                       # 0-based index of this step
            picked = [train_rows[i] for i in step_prompts(len(train_rows), step, P, seed)]
            t0 = time.perf_counter()
            completions = sample_groups(model, picked, G, session.adapter, config, step + 1,
                                        seed)
            t1 = time.perf_counter()
            raw, total_r = _score(scorer, completions, config.max_new_tokens)
            t2 = time.perf_counter()
            adv = compute_advantages(total_r.reshape(P, G), config.advantage).reshape(-1)
            kl_mean = None
            sequences = []
            if config.kl > 0:
                k3_all = []
                for c, a in zip(completions, adv):
                    logp = token_log_probs(model, c.prompt.ids, c.ids, session.adapter)
                    ref = token_log_probs(model, c.prompt.ids, c.ids, None)
                    w, k3 = kl_weights(a, logp, ref, config.kl)
                    sequences.append((c.prompt.ids, c.ids, w))
                    k3_all.append(k3)
                kl_mean = float(np.concatenate(k3_all).mean())
            else:
                sequences = [(c.prompt.ids, c.ids, np.full(len(c.ids), a))
                             for c, a in zip(completions, adv)]
            batches = policy_batches(sequences, config.micro_batch_tokens)
            t3 = time.perf_counter()
            metrics, bad = guarded_step(
                session, batches, state, config.max_bad_steps,
                oom_hint="Lower prompts_per_step, group_size or max_new_tokens, or the LoRA rank.",
                diverged_hint="Lower the learning rate, or set max_grad_norm / gclip.")
            t4 = time.perf_counter()
            for layer, counts in metrics.routing.items():
                routing_window[layer] = routing_window.get(layer, 0) + counts
            lengths = np.array([len(c.ids) for c in completions])
            n_gen = int(lengths.sum())
            spread = np.ptp(total_r.reshape(P, G), axis=1)
            done_steps = session.step_count - session_start
            elapsed = time.perf_counter() - t_loop
            eta = elapsed / done_steps * (total - session.step_count) if done_steps else 0.0
            r_mean, r_std = _stats(total_r)
            report(events.GRPO_STEP(
                step=session.step_count, total_steps=total,
                epoch=int(step * P // len(train_rows)) + 1, epochs=math.ceil(total / per_epoch),
                loss=metrics.loss, accuracy=metrics.accuracy, lr=metrics.lr,
                grad_norm=metrics.grad_norm, clipped_fraction=metrics.clipped_fraction,
                tokens=metrics.tokens, tokens_per_s=metrics.tokens_per_s, skipped=bad,
                reward_mean=r_mean, reward_std=r_std,
                rewards={n: dict(zip(("mean", "std"), _stats(raw[:, k])))
                         for k, n in enumerate(names)},
                zero_spread_fraction=float(np.mean(spread == 0)),
                completion_len_mean=float(lengths.mean()),
                completion_len_min=int(lengths.min()), completion_len_max=int(lengths.max()),
                completion_clipped_fraction=float(np.mean([not c.finished for c in completions])),
                advantage_mean=float(adv.mean()), advantage_std=float(adv.std()),
                advantage_abs_mean=float(np.abs(adv).mean()), kl=kl_mean, sample_s=t1 - t0,
                reward_s=t2 - t1, update_s=t4 - t3,
                sample_tokens_per_s=n_gen / max(t1 - t0, 1e-9), step_s=t4 - t0,
                elapsed_s=time.perf_counter() - t_start, eta_s=eta, rss_mb=peak_rss_mb()))
            done = session.step_count
            if config.samples_every and done % config.samples_every == 0:
                shown = completions[:config.samples_prompts * G]
                report(events.GRPO_SAMPLES(step=done, items=_sample_items(
                    shown, raw, total_r, adv, names, config.answer_field)))
            routing_window, stop_reason = between_steps(config, session, report, routing_window,
                                                        evaluate, save, should_stop)
        stopped = finish_run(stop_reason, state, session, ckpt_dir, evaluate, save)
        if stopped:
            return stopped
        report(events.GRPO_DONE(step=session.step_count, reason="finished",
                                skipped_steps=state["skipped_steps"],
                                elapsed_s=time.perf_counter() - t_start))
        return "done"


def run_grpo_job(run_dir, control) -> str:
    """The worker's runner for a GRPO run directory (config.json with "kind": "grpo"). Its
    custom reward files must be trusted as they are now: the user trusted them when submitting
    the job (app.engine.training.reward_functions)."""
    config = GrpoConfig.from_dict(run_dir.config())
    check_reward_trust(config.rewards, "Read the file; if you trust it, run "
                       f"`workbench resume {run_dir.path} --trust-reward-code`, or load the "
                       "run's config.json in New run and start it again.")
    return train_grpo(config, control.report, control.should_stop, run_dir.checkpoints_dir)
