"""The transformer: dense and MoE blocks of the supported architectures, assembled from kernels.

`Model.logits` walks the layers forward on the frozen base (plus an optional LoRA adapter) the
way llama.cpp's graphs do (SPEC-llamacpp.md sections 2-3); `Model.generate` decodes with a KV
cache. The training path (backward) builds on the same walk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterator, Sequence

import numpy as np

from app.engine.config import ModelConfig, config_from_metadata
from app.engine.errors import ConfigError, ModelFormatError
from app.engine.gguf_io import GGUFFile, read_gguf
from app.engine.kernels.activations import glu_forward, sigmoid
from app.engine.kernels.attention import attention_forward, attention_mask
from app.engine.kernels.linear import linear_forward
from app.engine.kernels.moe import combine, dispatch_order, experts_forward, router_forward
from app.engine.kernels.norm import rmsnorm_forward
from app.engine.kernels.rope import rope_angles, rope_forward
from app.engine.lora import LoraAdapter, check_adapter_fits
from app.engine.weights import WeightStore


@dataclass
class KVCache:
    """Per-layer keys and values of the tokens seen so far: (S, Hkv, D) each."""

    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.keys else int(self.keys[0].shape[0])


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Required tensors and their NumPy shapes; a missing or misshapen one is a format error."""
    c, hd = cfg.n_embd, cfg.head_dim
    q_out, kv_out = cfg.n_head * hd, cfg.n_head_kv * hd
    shapes = {"token_embd.weight": (cfg.n_vocab, c), "output_norm.weight": (c,)}
    if not cfg.tied_output:
        shapes["output.weight"] = (cfg.n_vocab, c)
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        shapes.update({p + "attn_norm.weight": (c,), p + "attn_q.weight": (q_out, c),
                       p + "attn_k.weight": (kv_out, c), p + "attn_v.weight": (kv_out, c),
                       p + "attn_output.weight": (c, q_out), p + "ffn_norm.weight": (c,)})
        if cfg.qk_norm == "head":
            shapes.update({p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})
        elif cfg.qk_norm == "full":
            shapes.update({p + "attn_q_norm.weight": (q_out,), p + "attn_k_norm.weight": (kv_out,)})
        if cfg.post_norms:
            shapes.update({p + "post_attention_norm.weight": (c,), p + "post_ffw_norm.weight": (c,)})
        if cfg.layer_is_moe(il):
            e, f = cfg.n_expert, cfg.n_ff_exp
            shapes.update({p + "ffn_gate_inp.weight": (e, c), p + "ffn_gate_exps.weight": (e, f, c),
                           p + "ffn_up_exps.weight": (e, f, c), p + "ffn_down_exps.weight": (e, c, f)})
            if cfg.n_ff_shexp:
                fs = cfg.n_ff_shexp
                shapes.update({p + "ffn_gate_shexp.weight": (fs, c), p + "ffn_up_shexp.weight": (fs, c),
                               p + "ffn_down_shexp.weight": (c, fs)})
            if cfg.shared_expert_gate:
                shapes[p + "ffn_gate_inp_shexp.weight"] = (c,)
        else:
            f = cfg.n_ff
            shapes.update({p + "ffn_gate.weight": (f, c), p + "ffn_up.weight": (f, c),
                           p + "ffn_down.weight": (c, f)})
    return shapes


class Model:
    """A GGUF language model ready for inference (and, with the training engine, for training)."""

    def __init__(self, gguf: GGUFFile, cache_budget: int | None = None):
        self.path = gguf.path
        self.gguf = gguf
        self.metadata = gguf.metadata
        self.config = config_from_metadata(gguf.metadata, gguf.tensors)
        self.weights = WeightStore(gguf, cache_budget)
        self._check_tensors()

    def _check_tensors(self) -> None:
        name = os.path.basename(self.path)
        for tname, want in _expected_shapes(self.config).items():
            if tname not in self.gguf.tensors:
                raise ModelFormatError(f"{name} is missing the tensor {tname!r} that a "
                                       f"'{self.config.arch}' model needs.",
                                       "The file is incomplete or was converted incorrectly.")
            got = self.gguf.tensors[tname].shape
            if got != want:
                raise ModelFormatError(f"{name}: tensor {tname!r} has shape {got}, expected {want} "
                                       "from the model's metadata.",
                                       "The file is corrupt or was converted incorrectly.")

    @cached_property
    def tokenizer(self):
        from app.engine.tokenizer import Tokenizer

        return Tokenizer.from_metadata(self.metadata)

    @property
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: t.shape for n, t in self.gguf.tensors.items()}

    # ---- forward ------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int], adapter: LoraAdapter | None = None,
               adapter_scale: float = 1.0) -> np.ndarray:
        """Logits (T, V) float32 for every position of `token_ids` (no BOS added)."""
        tokens = self._check_tokens(token_ids)
        lora = self._lora_lookup(adapter, adapter_scale)
        return self._forward(tokens, lora, KVCache(), last_only=False)

    def _check_tokens(self, token_ids) -> np.ndarray:
        tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            raise ConfigError("No tokens to evaluate.", "Give at least one token id.")
        if tokens.min() < 0 or tokens.max() >= self.config.n_vocab:
            raise ConfigError(f"Token ids must be in [0, {self.config.n_vocab}).",
                              "Use ids from this model's tokenizer.")
        return tokens

    def _lora_lookup(self, adapter, user_scale: float) -> Callable[[str], tuple | None]:
        if adapter is None:
            return lambda name: None
        check_adapter_fits(adapter, self.config.arch, self.tensor_shapes)
        return lambda name: adapter.scaled(name, user_scale)

    def _forward(self, tokens: np.ndarray, lora, cache: KVCache, last_only: bool) -> np.ndarray:
        cfg, w = self.config, self.weights
        start = cache.length
        positions = np.arange(start, start + len(tokens))                   # (T,)
        x = w.rows("token_embd.weight", tokens).astype(np.float32)          # (T, C)
        emb_lora = lora("token_embd.weight")
        if emb_lora is not None:
            a, b, s = emb_lora
            x = x + s * (a[tokens] @ b.T)                                   # (T, C)
        if cfg.embed_scale != 1.0:
            x = x * np.float32(cfg.embed_scale)
        for il in range(cfg.n_layer):
            x = self._block(il, x, positions, lora, cache)
        if last_only:
            x = x[-1:]
        h, _ = rmsnorm_forward(x, w.get("output_norm.weight"), cfg.rms_eps)
        head = "token_embd.weight" if cfg.tied_output else "output.weight"
        logits, _ = linear_forward(h, w.get(head), lora=lora(head))         # (T, V)
        if cfg.final_logit_softcap:
            cap = np.float32(cfg.final_logit_softcap)
            logits = cap * np.tanh(logits / cap)
        return logits.astype(np.float32, copy=False)

    def _block(self, il: int, x, positions, lora, cache: KVCache):
        cfg, w, p = self.config, self.weights, f"blk.{il}."
        h, _ = rmsnorm_forward(x, w.get(p + "attn_norm.weight"), cfg.rms_eps)
        attn = self._attention(il, h, positions, lora, cache)
        if cfg.post_norms:
            attn, _ = rmsnorm_forward(attn, w.get(p + "post_attention_norm.weight"), cfg.rms_eps)
        x = x + attn
        h, _ = rmsnorm_forward(x, w.get(p + "ffn_norm.weight"), cfg.rms_eps)
        ffn = self._moe(il, h, lora) if cfg.layer_is_moe(il) else self._ffn(p + "ffn_{}", h, lora)
        if cfg.post_norms:
            ffn, _ = rmsnorm_forward(ffn, w.get(p + "post_ffw_norm.weight"), cfg.rms_eps)
        return x + ffn

    def _linear(self, name: str, x, lora):
        wname = name + ".weight"
        bias = self.weights.get(name + ".bias") if name + ".bias" in self.weights else None
        y, _ = linear_forward(x, self.weights.get(wname), bias, lora(wname))
        return y

    def _attention(self, il: int, h, positions, lora, cache: KVCache):
        cfg, w, p = self.config, self.weights, f"blk.{il}."
        t, hd = h.shape[0], cfg.head_dim
        q = self._linear(p + "attn_q", h, lora)                              # (T, H*D)
        k = self._linear(p + "attn_k", h, lora)                              # (T, Hkv*D)
        v = self._linear(p + "attn_v", h, lora)                              # (T, Hkv*D)
        if cfg.qk_norm == "full":
            q, _ = rmsnorm_forward(q, w.get(p + "attn_q_norm.weight"), cfg.rms_eps)
            k, _ = rmsnorm_forward(k, w.get(p + "attn_k_norm.weight"), cfg.rms_eps)
        q = q.reshape(t, cfg.n_head, hd)                                     # (T, H, D)
        k = k.reshape(t, cfg.n_head_kv, hd)                                  # (T, Hkv, D)
        v = v.reshape(t, cfg.n_head_kv, hd)                                  # (T, Hkv, D)
        if cfg.qk_norm == "head":
            q, _ = rmsnorm_forward(q, w.get(p + "attn_q_norm.weight"), cfg.rms_eps)
            k, _ = rmsnorm_forward(k, w.get(p + "attn_k_norm.weight"), cfg.rms_eps)
        swa = bool(cfg.swa_layers and cfg.swa_layers[il])
        base, freq_scale = (cfg.rope_base_swa, 1.0) if swa else (cfg.rope_base, cfg.rope_freq_scale)
        cos, sin = rope_angles(np, positions, cfg.rope_dim, base, freq_scale, q.dtype)
        q, _ = rope_forward(q, cos, sin, cfg.rope_dim, cfg.rope_type)
        k, _ = rope_forward(k, cos, sin, cfg.rope_dim, cfg.rope_type)
        if il < len(cache.keys):                                             # decoding: append
            k = cache.keys[il] = np.concatenate([cache.keys[il], k])         # (S, Hkv, D)
            v = cache.values[il] = np.concatenate([cache.values[il], v])
        else:
            cache.keys.append(k)
            cache.values.append(v)
        k_pos = np.arange(k.shape[0])
        mask = attention_mask(np, positions, k_pos, cfg.sliding_window if swa else 0)
        out, _ = attention_forward(q, k, v, cfg.attn_scale, mask)            # (T, H, D)
        return self._linear(p + "attn_output", out.reshape(t, -1), lora)     # (T, C)

    def _ffn(self, pattern: str, h, lora):
        g = self._linear(pattern.format("gate"), h, lora)                   # (T, F)
        u = self._linear(pattern.format("up"), h, lora)                     # (T, F)
        act, _ = glu_forward(self.config.act, g, u)
        return self._linear(pattern.format("down"), act, lora)              # (T, C)

    def _moe(self, il: int, h, lora):
        cfg, w, p = self.config, self.weights, f"blk.{il}."
        router_logits = self._linear(p + "ffn_gate_inp", h, lora)           # (T, E)
        selected, weights, _ = router_forward(router_logits, cfg.n_expert_used,
                                              cfg.expert_weights_norm, cfg.expert_weights_scale)
        order, offsets, token_of = dispatch_order(selected, cfg.n_expert)
        names = [p + f"ffn_{proj}_exps.weight" for proj in ("gate", "up", "down")]
        ys = experts_forward(h, order, offsets, token_of, *(w.experts(n) for n in names),
                             cfg.act, tuple(lora(n) for n in names))        # (T*K, C)
        out = combine(ys, order, weights.astype(h.dtype))                   # (T, C)
        if cfg.n_ff_shexp:
            shared = self._ffn(p + "ffn_{}_shexp", h, lora)                 # (T, C)
            if cfg.shared_expert_gate:
                gate = h @ w.get(p + "ffn_gate_inp_shexp.weight")           # (T,)
                shared = shared * sigmoid(gate)[:, None]
            out = out + shared
        return out

    # ---- generation ---------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 64,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 adapter: LoraAdapter | None = None, adapter_scale: float = 1.0,
                 stop: Sequence[int] | None = None) -> Iterator[int]:
        """Yield new token ids one at a time (greedy when temperature is 0), with a KV cache.

        Stops after max_new_tokens, at a token in `stop` (default: the tokenizer's end-of-turn
        ids; the stop token itself is not yielded) or at the context length.
        """
        tokens = self._check_tokens(prompt_ids)
        lora = self._lora_lookup(adapter, adapter_scale)
        stop_ids = set(self.tokenizer.eot_ids if stop is None else stop)
        rng = np.random.default_rng(seed)
        cache = KVCache()
        logits = self._forward(tokens, lora, cache, last_only=True)[-1]
        for _ in range(max_new_tokens):
            if cache.length >= self.config.context_length:
                return
            token = sample_token(logits, temperature, top_p, rng)
            if token in stop_ids:
                return
            yield token
            logits = self._forward(np.array([token]), lora, cache, last_only=True)[-1]


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


def load_model(path: str | os.PathLike, cache_budget: int | None = None) -> Model:
    """Open a GGUF model: validate the file, read its config, memory-map its weights."""
    return Model(read_gguf(path), cache_budget)
