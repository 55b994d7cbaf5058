"""Decoding with a KV cache: `Model.generate` streams one sequence, `Model.generate_batch` many.

Both run the same loop (`_decode`): each distinct prompt is run once (several packed into one
forward) and its keys and values are copied into the cache row of every sequence that starts
with it (the G samples of a GRPO group share one prefill); then each step feeds one token per
live sequence as one (B, C) batch through the layers, token b at its own position lengths[b]
attending over its own cache row (rows padded to a common capacity and masked). A sequence ends
after a stop token, after max_new_tokens tokens or at the context length, and leaves the
batch. Sequence b samples with its own generator default_rng(seeds[b]) through `sample_token`,
so it gets the tokens it gets when decoded alone (up to float round-off in the batched
matmuls).
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

import numpy as np

from app.engine.errors import ConfigError
from app.engine.runtime.backend import get_array_module, to_host
from app.engine.model.context import ForwardContext

if TYPE_CHECKING:
    from app.engine.model.transformer import Model

PREFILL_TOKENS = 1024   # prompt tokens per prefill forward, whose attention mask is (T, T)


MAX_SEED = 2**64 - 1


def check_sampling(max_new_tokens, temperature, top_p, seeds: Sequence) -> None:
    """A ConfigError for a setting generation cannot use (a user types them: `workbench
    generate -t nan --seed -1`): max tokens a whole number from 0, temperature a finite number
    from 0 (0: greedy), top-p in (0, 1] (at 0 or below no token is left to sample), each seed
    None or a whole number from 0 to 2^64-1."""
    def number(value) -> bool:
        return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)

    if not isinstance(max_new_tokens, Integral) or max_new_tokens < 0:
        raise ConfigError(f"Max new tokens {max_new_tokens!r} is not a whole number from 0.",
                          "Give how many tokens to generate at most, e.g. 64.")
    if not number(temperature) or temperature < 0:
        raise ConfigError(f"Temperature {temperature!r} is not a number from 0 up.",
                          "0 generates greedily (the likeliest token each time); 0.7 to 1 "
                          "samples.")
    if not number(top_p) or not 0 < top_p <= 1:
        raise ConfigError(f"Top-p {top_p!r} is not a number above 0 and at most 1.",
                          "1 samples from every token; 0.9 from the likeliest ones that make up "
                          "90% of the probability.")
    for seed in seeds:
        if seed is not None and (not isinstance(seed, Integral) or not 0 <= seed <= MAX_SEED):
            raise ConfigError(f"Seed {seed!r} is not a whole number from 0 to 2^64-1.",
                              "Any number in that range gives a repeatable sample; leave it "
                              "out for a different one each time.")


def sample_token(logits: np.ndarray, temperature: float, top_p: float, rng) -> int:
    """Greedy for temperature <= 0; otherwise nucleus sampling from softmax(logits / T)."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        keep = np.cumsum(probs[order]) - probs[order] < top_p    # always keeps the top token
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return int(rng.choice(len(probs), p=probs))


class KVCache:
    """Keys and values of B sequences decoded together, per layer (B, Hkv, L, D), padded to a
    capacity of L positions: sequence b holds its first lengths[b] tokens, the rest is masked."""

    def __init__(self, prompts: Sequence[list], capacity: int):
        """prompts: per sequence, its prompt's (k, v) per layer, each (T_b, Hkv, D)."""
        self.lengths = np.array([len(layers[0][0]) for layers in prompts])          # (B,)
        self.capacity = capacity
        by_layer = list(zip(*prompts))                       # per layer: per sequence (k, v)
        self.keys = [_pad([k for k, _ in layer], capacity) for layer in by_layer]
        self.values = [_pad([v for _, v in layer], capacity) for layer in by_layer]

    def write(self, il: int, k, v):
        """Store layer il's k, v (B, Hkv, D) of the tokens at positions `lengths`; return the
        layer's keys and values (B, Hkv, L, D)."""
        xp = get_array_module(k)
        rows, at = xp.arange(len(self.lengths)), xp.asarray(self.lengths)
        self.keys[il][rows, :, at] = k
        self.values[il][rows, :, at] = v
        return self.keys[il], self.values[il]

    def keep(self, rows: np.ndarray) -> None:
        """Drop the sequences where `rows` (B,) is False."""
        self.lengths = self.lengths[rows]
        on_device = get_array_module(self.keys[0]).asarray(rows)
        self.keys = [k[on_device] for k in self.keys]
        self.values = [v[on_device] for v in self.values]


def _pad(rows: list, capacity: int) -> np.ndarray:
    """(B, Hkv, L, D) of B arrays (T_b, Hkv, D), zeros after each one's T_b positions."""
    _, n_kv, d = rows[0].shape
    out = get_array_module(rows[0]).zeros((len(rows), n_kv, capacity, d), rows[0].dtype)
    for b, x in enumerate(rows):
        out[b, :, :len(x)] = x.transpose(1, 0, 2)
    return out


class _DecodeStep(ForwardContext):
    """One decoding step: token b at position lengths[b] of sequence b, over that sequence's keys."""

    def __init__(self, cfg, cache: KVCache, xp):
        super().__init__(cfg, cache.lengths, np.arange(cache.capacity), None, cache, xp)

    def attend(self, il: int, q, k, v, swa: bool):
        keys, values = self.kv.write(il, k, v)                              # (B, Hkv, L, D)
        mask = self.mask(swa, q.dtype)                                      # (B, L)
        b, n_head, d = q.shape
        qg = q.reshape(b, keys.shape[1], -1, d)                             # (B, Hkv, G, D)
        scores = qg @ keys.transpose(0, 1, 3, 2) * self.cfg.attn_scale + mask[:, None, None]
        probs = self.xp.exp(scores - scores.max(-1, keepdims=True))         # (B, Hkv, G, L)
        probs /= probs.sum(-1, keepdims=True)
        return (probs @ values).reshape(b, n_head, -1), None                # (B, H, Dv)


def _prefill(model: Model, params, prompts: list[tuple[int, ...]]) -> dict:
    """prompt -> (next-token logits (V,), per layer (k, v) (T, Hkv, D)). The prompts run packed
    into forwards of at most PREFILL_TOKENS tokens (a longer prompt alone), each attending
    within itself only."""
    packs = [[]]
    for p in prompts:
        if packs[-1] and sum(map(len, packs[-1])) + len(p) > PREFILL_TOKENS:
            packs.append([])
        packs[-1].append(p)
    out = {}
    for pack in packs:
        lengths = [len(p) for p in pack]
        ends = np.cumsum(lengths)                                           # (P,)
        layers = []                                          # per layer (k, v) (sum T, Hkv, D)
        ctx = ForwardContext.build(model.config, ends[-1], layers,
                             np.concatenate([np.arange(n) for n in lengths]),
                             np.repeat(np.arange(len(pack)), lengths), model.xp)
        x = model.hidden(np.concatenate(pack), params, ctx)                # (sum T, C)
        logits = to_host(model.head_logits(x[model.xp.asarray(ends - 1)], params))  # (P, V)
        for p, end, z in zip(pack, ends, logits):
            span = slice(end - len(p), end)
            out[p] = z, [(k[span], v[span]) for k, v in layers]
    return out


def _decode(model: Model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
            temperature: float, top_p: float, seeds: Sequence[int | None], adapter,
            adapter_scale: float, stop_ids: set[int],
            llamacpp_numerics: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (sequence indices (n,), their next tokens (n,)) at each step while any sequence is
    live. A sequence ends after a token in `stop_ids` (yielded), after max_new_tokens tokens or
    when its prompt and tokens fill the context. llamacpp_numerics: see Model.logits."""
    check_sampling(max_new_tokens, temperature, top_p, seeds)
    cfg = model.config
    params = model.params(adapter, adapter_scale, llamacpp_numerics=llamacpp_numerics)
    prompts = [tuple(model.check_tokens(p).tolist()) for p in prompts]
    budget = np.array([min(max_new_tokens, cfg.context_length - len(p)) for p in prompts])
    live = np.flatnonzero(budget > 0)                        # (B,) the sequences decoding
    if not live.size:
        return
    prefilled = _prefill(model, params, list(dict.fromkeys(prompts[b] for b in live)))
    capacity = max(len(prompts[b]) + budget[b] for b in live)     # the last token is not fed
    cache = KVCache([prefilled[prompts[b]][1] for b in live], capacity)
    logits = np.stack([prefilled[prompts[b]][0] for b in live])                   # (B, V)
    rngs = [np.random.default_rng(s) for s in seeds]
    for n in range(1, max_new_tokens + 1):
        tokens = np.array([sample_token(z, temperature, top_p, rngs[b])
                           for z, b in zip(logits, live)])    # (B,)
        yield live, tokens
        going = (budget[live] > n) & ~np.isin(tokens, list(stop_ids))      # (B,)
        if not going.all():
            live, tokens = live[going], tokens[going]
            cache.keep(going)
        if not live.size:
            return
        x = model.hidden(tokens, params, _DecodeStep(cfg, cache, model.xp))  # (B, C)
        cache.lengths = cache.lengths + 1
        logits = to_host(model.head_logits(x, params))                    # (B, V) to sample


def generate(model: Model, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float,
             top_p: float, seed: int | None, adapter, adapter_scale: float,
             stop: Sequence[int] | None, llamacpp_numerics: bool) -> Iterator[int]:
    """`Model.generate`: the new ids one at a time, without the stop token."""
    stop_ids = _stop_ids(model, stop)
    for _, (token,) in _decode(model, [prompt_ids], max_new_tokens, temperature, top_p, [seed],
                               adapter, adapter_scale, stop_ids, llamacpp_numerics):
        if token in stop_ids:
            return
        yield int(token)


def generate_batch(model: Model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   temperature: float, top_p: float, seeds: Sequence[int | None] | None, adapter,
                   adapter_scale: float, stop: Iterable[int] | None,
                   llamacpp_numerics: bool) -> list[list[int]]:
    """`Model.generate_batch`: each sequence's new ids, its stop token kept as the last id."""
    seeds = [None] * len(prompts) if seeds is None else seeds
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts: give one per prompt")
    out: list[list[int]] = [[] for _ in prompts]
    for rows, tokens in _decode(model, prompts, max_new_tokens, temperature, top_p, seeds,
                                adapter, adapter_scale, _stop_ids(model, stop),
                                llamacpp_numerics):
        for b, token in zip(rows, tokens.tolist()):
            out[b].append(token)
    return out


def _stop_ids(model: Model, stop: Iterable[int] | None) -> set[int]:
    return set(model.tokenizer.eot_ids if stop is None else stop)
