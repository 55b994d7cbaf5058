"""The transformer: dense and MoE blocks of the supported architectures, assembled from kernels.

`Model.logits` walks the layers forward on the frozen base (plus an optional LoRA adapter) the
way llama.cpp's graphs do (SPEC-llamacpp.md sections 2-3); `Model.generate` and
`Model.generate_batch` decode with a KV cache (app.engine.model.generation). The training path
(backward) builds on the same walk.
"""

from __future__ import annotations

import os
from functools import cached_property, partial
from typing import Any, Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from app.engine.runtime.backend import array_module, to_host
from app.engine.model.config import ModelConfig, config_from_metadata
from app.engine.model.context import ForwardContext
from app.engine.model.generation import generate, generate_batch
from app.engine.errors import ConfigError, ModelFormatError
from app.engine.io.gguf import GGUFFile, read_gguf
from app.engine.kernels.activations import (GegluCache, SwigluCache, geglu_forward,
                                            glu_backward, sigmoid, sigmoid_backward,
                                            swiglu_forward)
from app.engine.kernels.attention import AttentionCache, attention_backward
from app.engine.kernels.embedding import (EmbeddingCache, LoraEmbeddingCache, embedding_backward,
                                          embedding_forward, lora_embedding_backward,
                                          lora_embedding_forward)
from app.engine.kernels.linear import (Linear, LinearCache, linear_backward_group, linear_forward,
                                       linear_forward_group)
from app.engine.kernels.loss import (VOCAB_CHUNK, cross_entropy_backward, cross_entropy_forward,
                                     cross_entropy_frozen_head, label_log_probs)
from app.engine.kernels.moe import (CombineCache, ExpertsCache, RouterCache, combine_backward,
                                    combine_forward, dispatch_order, experts_backward,
                                    experts_forward, experts_forward_train, router_backward,
                                    router_forward)
from app.engine.kernels.norm import RmsNormCache, rmsnorm_backward, rmsnorm_forward
from app.engine.kernels.rope import RopeCache, rope_backward, rope_forward
from app.engine.model.lora import LoraAdapter, check_adapter_fits
from app.engine.model.params import Grads, Params
from app.engine.runtime.timing import phase
from app.engine.model.weights import WeightStore
from app.engine.text.tokenizer import Tokenizer


class LinearLayerCache(NamedTuple):
    """A projection: its tensor's name (`name`.weight, `name`.bias) and the kernel's cache with
    w = None; the backward fetches the weight again (Model._linear_forward)."""

    name: str
    linear: LinearCache


class EmbedCache(NamedTuple):
    """The token embedding: the table's cache (None for a frozen table) and its LoRA's (None
    without one)."""

    table: EmbeddingCache | None
    lora: LoraEmbeddingCache | None


class AttentionBlockCache(NamedTuple):
    """A layer's attention: the q, k, v projections (T, C) -> (T, H*D), (T, Hkv*D), the q/k
    norms (None without cfg.qk_norm), the rotations of q (T, H, D) and k (T, Hkv, D), the
    attention (None when decoding) and the output projection (T, H*D) -> (T, C)."""

    q: LinearLayerCache
    k: LinearLayerCache
    v: LinearLayerCache
    q_norm: RmsNormCache | None
    k_norm: RmsNormCache | None
    q_rope: RopeCache
    k_rope: RopeCache
    attn: AttentionCache | None
    o: LinearLayerCache


class FfnCache(NamedTuple):
    """A gated FFN (dense, or an MoE layer's shared expert): gate and up (T, C) -> (T, F), the
    activation (T, F), down (T, F) -> (T, C)."""

    gate: LinearLayerCache
    up: LinearLayerCache
    act: SwigluCache | GegluCache
    down: LinearLayerCache


class SharedExpertCache(NamedTuple):
    """An MoE layer's shared expert: its FFN, its output (T, C), its sigmoid gate (T,) or None
    (ungated), and the layer's input h (T, C) for the gate's gradient."""

    ffn: FfnCache
    out: Any
    gate: Any
    h: Any


class MoeCache(NamedTuple):
    """An MoE FFN: the router's projection (T, C) -> (T, E), the top-K routing, the experts
    (T*K slots; None on the inference path), the combine (T, C), the shared expert or None."""

    router_in: LinearLayerCache
    router: RouterCache
    experts: ExpertsCache | None
    combine: CombineCache
    shared: SharedExpertCache | None


class BlockCache(NamedTuple):
    """A transformer block on x (T, C): its norms (post_attn, post_ffw None without
    cfg.post_norms), its attention and its FFN, dense or MoE."""

    attn_norm: RmsNormCache
    attn: AttentionBlockCache
    post_attn: RmsNormCache | None
    ffn_norm: RmsNormCache
    ffn: FfnCache | MoeCache
    post_ffw: RmsNormCache | None


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
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

    def __init__(self, gguf: GGUFFile, cache_budget: int | None = None, device: str = "cpu"):
        self.path = gguf.path
        self.gguf = gguf
        self.metadata = gguf.metadata
        self.config = config_from_metadata(gguf.metadata, gguf.tensors)
        self.xp = array_module(device)  # numpy, or cupy: where weights and activations live
        self.weights = WeightStore(gguf, cache_budget, self.xp)
        self._check_tensors()

    def _check_tensors(self) -> None:
        name = os.path.basename(self.path)
        for tname, want in expected_shapes(self.config).items():
            if tname not in self.gguf.tensors:
                raise ModelFormatError(f"{name} is missing the tensor {tname!r} that a "
                                       f"'{self.config.arch}' model needs.",
                                       "The file is incomplete or was converted incorrectly.")
            self._check_shape(tname, want)
        for tname in self.gguf.tensors:  # optional biases must fit their weight
            if tname.endswith(".bias") and tname[:-5] + ".weight" in self.gguf.tensors:
                self._check_shape(tname, self.gguf.tensors[tname[:-5] + ".weight"].shape[:1])

    def _check_shape(self, tname: str, want: tuple[int, ...]) -> None:
        got = self.gguf.tensors[tname].shape
        if got != tuple(want):
            raise ModelFormatError(f"{os.path.basename(self.path)}: tensor {tname!r} has shape "
                                   f"{got}, expected {tuple(want)} from the model's metadata.",
                                   "The file is corrupt or was converted incorrectly.")

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_metadata(self.metadata)

    @property
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: t.shape for n, t in self.gguf.tensors.items()}

    # ---- parameters --------------------------------------------------------------------
    def params(self, adapter: LoraAdapter | None = None, adapter_scale: float = 1.0,
               full: dict | None = None, dtype=np.float32, training: bool = False,
               llamacpp_numerics: bool = False) -> Params:
        """A view of the weights for one forward pass (see app.engine.model.params; llamacpp_numerics:
        round activations as llama.cpp does before quantized matmuls, inference only)."""
        if adapter is not None:
            check_adapter_fits(adapter, self.config.arch, self.tensor_shapes)
        return Params(self.weights, dtype, full, adapter, adapter_scale, training,
                      llamacpp_numerics)

    # ---- inference ---------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int], adapter: LoraAdapter | None = None,
               adapter_scale: float = 1.0, llamacpp_numerics: bool = True) -> np.ndarray:
        """Logits (T, V) float32 for every position of `token_ids` (no BOS added).

        llamacpp_numerics (default): quantized weights multiply activations rounded as
        llama.cpp's CPU backend rounds them (Params.base_input), which matches its logits to
        ~1e-6 on the tiny golden models (on a real model the roundings amplify float32 noise
        to whole logits, and a prefix's logits depend on the sequence length as much: see
        app.engine.kernels.act_quants); False computes in plain float32, as training does."""
        tokens = self.check_tokens(token_ids)
        params = self.params(adapter, adapter_scale, llamacpp_numerics=llamacpp_numerics)
        x = self.hidden(tokens, params, ForwardContext.build(self.config, tokens.size, None, xp=self.xp))
        return to_host(self.head_logits(x, params))

    def check_tokens(self, token_ids) -> np.ndarray:
        tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            raise ConfigError("No tokens to evaluate.", "Give at least one token id.")
        if tokens.min() < 0 or tokens.max() >= self.config.n_vocab:
            raise ConfigError(f"Token ids must be in [0, {self.config.n_vocab}).",
                              "Use ids from this model's tokenizer.")
        return tokens

    def hidden(self, tokens, params: Params, ctx: "ForwardContext"):
        """Final hidden states (T, C) before the output norm, caches dropped as soon as unused."""
        x, _ = self._embed_forward(tokens, params)
        for il in range(self.config.n_layer):
            x, _ = self._block_forward(il, x, params, ctx)
        return x

    def head_logits(self, x, params: Params) -> np.ndarray:
        cfg = self.config
        h, _ = rmsnorm_forward(x, params.weight("output_norm.weight"), cfg.rms_eps)
        head = self.head_name
        logits, _ = linear_forward(h, params.weight(head), lora=self._head_lora(params),
                                   x_base=params.base_input(head, h))                  # (T, V)
        if cfg.final_logit_softcap:
            cap = np.float32(cfg.final_logit_softcap)
            logits = cap * self.xp.tanh(logits / cap)
        return logits.astype(np.float32, copy=False)

    def _head_lora(self, params: Params):
        """The output head's LoRA. A tied head is the token embedding, whose adapter has the
        embedding layout (A per token row) and adapts the lookup only: it is not applied to the
        head (llama.cpp would try to, by tensor name, and fail on the shapes)."""
        return None if self.config.tied_output else params.lora(self.head_name)

    @property
    def head_name(self) -> str:
        return "token_embd.weight" if self.config.tied_output else "output.weight"

    # ---- training: loss and gradients ----------------------------------------------------
    def loss(self, params: Params, tokens, labels, token_weights=None, positions=None,
             segments=None, vocab_chunk: int = VOCAB_CHUNK):
        """(loss, stats) as in loss_and_grads, forward only (evaluation)."""
        loss, stats, _ = self._loss_forward(params, tokens, labels, token_weights, positions,
                                            segments, vocab_chunk)
        return loss, stats

    def label_log_probs(self, params: Params, tokens, labels, positions=None, segments=None,
                        vocab_chunk: int = VOCAB_CHUNK):
        """(T,) log p(labels_t | tokens_<=t) through the loss head (forward only, no (T, V)
        logits kept), 0 where the label is -1: summed over a completion's tokens, its
        log-probability (preference training)."""
        _, _, cache = self._loss_forward(params, tokens, labels, None, positions, segments,
                                         vocab_chunk)
        return label_log_probs(cache)

    def _loss_forward(self, params: Params, tokens, labels, token_weights, positions, segments,
                      vocab_chunk: int):
        tokens = self.check_tokens(tokens)
        ctx = ForwardContext.build(self.config, tokens.size, None, positions, segments, self.xp)
        x = self.hidden(tokens, params, ctx)
        h, _ = rmsnorm_forward(x, params.weight("output_norm.weight"), self.config.rms_eps)
        head = self.head_name
        loss, stats, cache = cross_entropy_forward(
            h, params.row_view(head), self.xp.asarray(labels), token_weights,
            self._head_lora(params), self.config.final_logit_softcap, vocab_chunk)
        return loss, {**stats, "routing": ctx.routing}, cache

    def loss_and_grads(self, params: Params, tokens, labels, token_weights=None,
                       positions=None, segments=None, checkpoint_interval: int = 0,
                       vocab_chunk: int = VOCAB_CHUNK):
        """Weighted cross-entropy of `labels` given `tokens` and its gradients.

        tokens, labels: (T,) with label -1 = not trained; token_weights (T,) or None;
        positions (T,) RoPE positions (default 0..T-1); segments (T,) sequence ids of packed
        sequences (attention never crosses a segment boundary). checkpoint_interval N > 0 keeps
        only the input of every N-th layer and recomputes the rest during backward.
        Returns (loss, stats, grads) with grads named as in `app.engine.model.params.Grads`.
        """
        cfg = self.config
        tokens = self.check_tokens(tokens)
        params.forget_packed()    # trained tensors may have changed since the last pass (bf16)
        ctx = ForwardContext.build(cfg, tokens.size, None, positions, segments, self.xp)
        grads = Grads()
        n, every = cfg.n_layer, checkpoint_interval
        saved = {}  # layer -> its input (checkpoints) or its caches (no checkpointing)
        with phase("forward"):
            x, emb_cache = self._embed_forward(tokens, params)
            for il in range(n):
                if every:
                    if il % every == 0:
                        saved[il] = x
                    x = self._block_forward(il, x, params, ctx)[0]   # its cache dies here
                else:
                    x, saved[il] = self._block_forward(il, x, params, ctx)
        with phase("loss"):
            h, norm_cache = rmsnorm_forward(x, params.weight("output_norm.weight"), cfg.rms_eps)
            head, head_lora = self.head_name, self._head_lora(params)
            head_args = (h, params.row_view(head), self.xp.asarray(labels), token_weights)
            if params.trains(head) or head_lora is not None:
                loss, stats, loss_cache = cross_entropy_forward(
                    *head_args, head_lora, cfg.final_logit_softcap, vocab_chunk)
                dh, dw, dlora = cross_entropy_backward(loss_cache, need_dw=params.trains(head))
                del loss_cache
                _add_weight_grads(grads, head, dw, dlora)
            else:                       # a frozen head: dh in the same pass as the loss
                loss, stats, dh = cross_entropy_frozen_head(*head_args, cfg.final_logit_softcap,
                                                            vocab_chunk)
            dx, dnorm = rmsnorm_backward(dh, norm_cache)
            _add_full(grads, params, "output_norm.weight", dnorm)
        if every:
            for start in reversed(range(0, n, every)):
                x, caches = saved.pop(start), []
                with phase("recompute"):
                    for il in range(start, min(start + every, n)):   # recompute the segment
                        x, cache = self._block_forward(il, x, params, ctx)
                        caches.append(cache)
                with phase("backward"):
                    for il in reversed(range(start, min(start + every, n))):
                        dx = self._block_backward(il, dx, caches.pop(), params, grads)
        else:
            with phase("backward"):
                for il in reversed(range(n)):
                    dx = self._block_backward(il, dx, saved.pop(il), params, grads)
        with phase("backward"):
            self._embed_backward(dx, emb_cache, params, grads)
        return loss, {**stats, "routing": ctx.routing}, grads

    # ---- layer walk: forward (with caches) and backward ------------------------------------
    def _embed_forward(self, tokens, params: Params):
        name, cfg = "token_embd.weight", self.config
        if params.trains(name):
            x, table_cache = embedding_forward(params.weight(name), self.xp.asarray(tokens))
        else:
            x, table_cache = params.rows(name, tokens), None                   # (T, C)
        lora = params.lora(name)
        lora_cache = None
        if lora is not None:
            delta, lora_cache = lora_embedding_forward(lora[0], lora[1], self.xp.asarray(tokens),
                                                       lora[2])
            x = x + delta
        if cfg.embed_scale != 1.0:
            x = x * x.dtype.type(cfg.embed_scale)
        return x, EmbedCache(table_cache, lora_cache)

    def _embed_backward(self, dx, cache: EmbedCache, params: Params, grads: Grads) -> None:
        name, cfg = "token_embd.weight", self.config
        if cfg.embed_scale != 1.0:
            dx = dx * dx.dtype.type(cfg.embed_scale)
        if cache.table is not None:
            grads.add(name, embedding_backward(dx, cache.table, cfg.n_vocab))
        if cache.lora is not None:
            da, db = lora_embedding_backward(dx, cache.lora)
            _add_weight_grads(grads, name, None, (da, db))

    def _block_forward(self, il: int, x, params: Params, ctx: "ForwardContext"):
        cfg, p, eps = self.config, f"blk.{il}.", self.config.rms_eps
        c_post_attn = c_post_ffw = None
        h, c_attn_norm = rmsnorm_forward(x, params.weight(p + "attn_norm.weight"), eps)
        attn, c_attn = self._attention_forward(il, h, params, ctx)
        if cfg.post_norms:
            attn, c_post_attn = rmsnorm_forward(
                attn, params.weight(p + "post_attention_norm.weight"), eps)
        x = x + attn
        h, c_ffn_norm = rmsnorm_forward(x, params.weight(p + "ffn_norm.weight"), eps)
        if cfg.layer_is_moe(il):
            ffn, c_ffn = self._moe_forward(il, h, params, ctx)
        else:
            ffn, c_ffn = self._ffn_forward(p + "ffn_{}", h, params)
        if cfg.post_norms:
            ffn, c_post_ffw = rmsnorm_forward(ffn, params.weight(p + "post_ffw_norm.weight"), eps)
        return x + ffn, BlockCache(attn_norm=c_attn_norm, attn=c_attn, post_attn=c_post_attn,
                                   ffn_norm=c_ffn_norm, ffn=c_ffn, post_ffw=c_post_ffw)

    def _block_backward(self, il: int, dx, c: BlockCache, params: Params, grads: Grads):
        cfg, p = self.config, f"blk.{il}."
        dffn = dx
        if cfg.post_norms:
            dffn = self._norm_backward(dffn, c.post_ffw, p + "post_ffw_norm.weight", params, grads)
        if cfg.layer_is_moe(il):
            dh = self._moe_backward(il, dffn, c.ffn, params, grads)
        else:
            dh = self._ffn_backward(dffn, c.ffn, params, grads)
        dx = dx + self._norm_backward(dh, c.ffn_norm, p + "ffn_norm.weight", params, grads)
        dattn = dx
        if cfg.post_norms:
            dattn = self._norm_backward(dattn, c.post_attn, p + "post_attention_norm.weight",
                                        params, grads)
        dh = self._attention_backward(il, dattn, c.attn, params, grads)
        return dx + self._norm_backward(dh, c.attn_norm, p + "attn_norm.weight", params, grads)

    def _norm_backward(self, dout, cache, name: str, params: Params, grads: Grads):
        dx, dw = rmsnorm_backward(dout, cache)
        _add_full(grads, params, name, dw)
        return dx

    def _linear_forward(self, name: str, x, params: Params):
        """y = x W^T (+ b) (+ LoRA) for the tensor `name`.weight; cache for _linear_backward."""
        return self._linear_forward_group((name,), x, params)[0]

    def _linear_forward_group(self, names, x, params: Params):
        """[(y, cache)] of the layers `names`, which read the same x, in one parallel section.
        Their biases, LoRA, dropout masks and weights are fetched here, in the order of
        `names` (the dropout masks draw from the run's generator in that order)."""
        layers = []
        for name in names:
            bias_name = name + ".bias"
            lora = params.lora(name + ".weight")
            layers.append(Linear(
                params.base_weight(name + ".weight"),
                params.weight(bias_name) if params.has(bias_name) else None, lora,
                None if lora is None else params.dropout_mask(name, x.shape, x.dtype),
                params.base_input(name + ".weight", x)))
        # The weight is fetched again in backward, not kept in the cache: a quantized weight
        # that the WeightStore's budget does not keep would otherwise stay alive, dequantized,
        # across the step (every layer's: the whole model in float32). Cached or F32 weights
        # cost a lookup.
        return [(y, LinearLayerCache(name, cache._replace(w=None)))
                for name, (y, cache) in zip(names, linear_forward_group(x, layers))]

    def _linear_backward(self, dy, lcache: LinearLayerCache, params: Params, grads: Grads):
        return self._linear_backward_group((dy,), (lcache,), params, grads)

    def _linear_backward_group(self, dys, lcaches, params: Params, grads: Grads):
        """The summed input gradient of layers that read the same x (in the order given); their
        weight, bias and LoRA gradients go to `grads`."""
        wnames = [lcache.name + ".weight" for lcache in lcaches]
        caches = [lcache.linear._replace(w=params.base_weight(wname))
                  for lcache, wname in zip(lcaches, wnames)]
        dx, layer_grads = linear_backward_group(dys, caches,
                                                [params.trains(wname) for wname in wnames])
        for lcache, wname, (dw, dbias, dlora) in zip(lcaches, wnames, layer_grads):
            _add_weight_grads(grads, wname, dw, dlora)
            _add_full(grads, params, lcache.name + ".bias", dbias)
        return dx

    def _attention_forward(self, il: int, h, params: Params, ctx: "ForwardContext"):
        cfg, p, eps = self.config, f"blk.{il}.", self.config.rms_eps
        t, hd = h.shape[0], cfg.head_dim
        cq_norm = ck_norm = None
        (q, cq), (k, ck), (v, cv) = self._linear_forward_group(
            (p + "attn_q", p + "attn_k", p + "attn_v"), h, params)  # (T, H*D), 2 x (T, Hkv*D)
        if cfg.qk_norm == "full":
            q, cq_norm = rmsnorm_forward(q, params.weight(p + "attn_q_norm.weight"), eps)
            k, ck_norm = rmsnorm_forward(k, params.weight(p + "attn_k_norm.weight"), eps)
        q = q.reshape(t, cfg.n_head, hd)                                     # (T, H, D)
        k = k.reshape(t, cfg.n_head_kv, hd)                                  # (T, Hkv, D)
        v = v.reshape(t, cfg.n_head_kv, hd)                                  # (T, Hkv, D)
        if cfg.qk_norm == "head":
            q, cq_norm = rmsnorm_forward(q, params.weight(p + "attn_q_norm.weight"), eps)
            k, ck_norm = rmsnorm_forward(k, params.weight(p + "attn_k_norm.weight"), eps)
        swa = bool(cfg.swa_layers and cfg.swa_layers[il])
        cos, sin = ctx.rope(swa, q.dtype)
        q, cq_rope = rope_forward(q, cos, sin, cfg.rope_dim, cfg.rope_type)
        k, ck_rope = rope_forward(k, cos, sin, cfg.rope_dim, cfg.rope_type)
        out, c_attn = ctx.attend(il, q, k, v, swa)
        y, co = self._linear_forward(p + "attn_output", out.reshape(t, -1), params)
        return y, AttentionBlockCache(q=cq, k=ck, v=cv, q_norm=cq_norm, k_norm=ck_norm,
                                      q_rope=cq_rope, k_rope=ck_rope, attn=c_attn, o=co)

    def _attention_backward(self, il: int, dy, c: AttentionBlockCache, params: Params,
                            grads: Grads):
        cfg, p = self.config, f"blk.{il}."
        dout = self._linear_backward(dy, c.o, params, grads)                 # (T, H*D)
        t = dout.shape[0]
        dq, dk, dv = attention_backward(dout.reshape(t, cfg.n_head, -1), c.attn)
        dq, dk = rope_backward(dq, c.q_rope), rope_backward(dk, c.k_rope)
        if cfg.qk_norm == "head":
            dq = self._norm_backward(dq, c.q_norm, p + "attn_q_norm.weight", params, grads)
            dk = self._norm_backward(dk, c.k_norm, p + "attn_k_norm.weight", params, grads)
        dq, dk, dv = dq.reshape(t, -1), dk.reshape(t, -1), dv.reshape(t, -1)
        if cfg.qk_norm == "full":
            dq = self._norm_backward(dq, c.q_norm, p + "attn_q_norm.weight", params, grads)
            dk = self._norm_backward(dk, c.k_norm, p + "attn_k_norm.weight", params, grads)
        return self._linear_backward_group((dq, dk, dv), (c.q, c.k, c.v), params, grads)

    def _glu(self, g, u, params: Params):
        if self.config.act == "silu":
            return swiglu_forward(g, u)
        return geglu_forward(g, u, exact=params.training)

    def _ffn_forward(self, pattern: str, h, params: Params):
        (g, cg), (u, cu) = self._linear_forward_group(
            (pattern.format("gate"), pattern.format("up")), h, params)     # 2 x (T, F)
        act, ca = self._glu(g, u, params)                                    # (T, F)
        y, cd = self._linear_forward(pattern.format("down"), act, params)   # (T, C)
        return y, FfnCache(gate=cg, up=cu, act=ca, down=cd)

    def _ffn_backward(self, dy, c: FfnCache, params: Params, grads: Grads):
        dact = self._linear_backward(dy, c.down, params, grads)
        dg, du = glu_backward(self.config.act, dact, c.act)
        return self._linear_backward_group((dg, du), (c.gate, c.up), params, grads)

    def _moe_forward(self, il: int, h, params: Params, ctx: ForwardContext):
        cfg, p = self.config, f"blk.{il}."
        logits, c_router_in = self._linear_forward(p + "ffn_gate_inp", h, params)   # (T, E)
        selected, weights, c_router = router_forward(logits, cfg.n_expert_used,
                                                     cfg.expert_weights_norm, cfg.expert_weights_scale)
        order, offsets, token_of = dispatch_order(selected, cfg.n_expert)
        offsets = to_host(offsets)    # (E+1,) the one device read of the layer: segment bounds
        ctx.routing[il] = np.diff(offsets)        # a recomputed layer writes the same counts
        names = self._expert_names(il)
        weights_e = [params.experts(n) for n in names]
        loras = tuple(params.lora(n) for n in names)
        if params.training:  # exact GELU, caches for backward
            ys, c_experts = experts_forward_train(h, order, offsets, token_of, *weights_e,
                                                  cfg.act, loras)                   # (T*K, C)
        else:                # ggml's fp16 GELU table, as llama.cpp computes it
            base_inputs = tuple(partial(params.base_input, n) for n in names)
            ys, c_experts = experts_forward(h, order, offsets, token_of, *weights_e, cfg.act,
                                            loras, base_inputs), None
        out, c_combine = combine_forward(ys, order, weights.astype(h.dtype))         # (T, C)
        c_shared = None
        if cfg.n_ff_shexp:
            shared, c_ffn = self._ffn_forward(p + "ffn_{}_shexp", h, params)        # (T, C)
            gate = None
            if cfg.shared_expert_gate:
                gate = sigmoid(h @ params.weight(p + "ffn_gate_inp_shexp.weight"))  # (T,)
                out = out + shared * gate[:, None]
            else:
                out = out + shared
            c_shared = SharedExpertCache(ffn=c_ffn, out=shared, gate=gate, h=h)
        return out, MoeCache(router_in=c_router_in, router=c_router, experts=c_experts,
                             combine=c_combine, shared=c_shared)

    def _moe_backward(self, il: int, dy, c: MoeCache, params: Params, grads: Grads):
        names = self._expert_names(il)
        dys, dweights = combine_backward(dy, c.combine)
        dh, dws, dloras = experts_backward(dys, c.experts, tuple(params.trains(n) for n in names))
        for name, dw, dlora in zip(names, dws, dloras):
            _add_weight_grads(grads, name, dw, dlora)
        dlogits = router_backward(dweights, c.router)
        dh = dh + self._linear_backward(dlogits.astype(dy.dtype), c.router_in, params, grads)
        if c.shared is not None:
            shared = c.shared
            dshared = dy
            if shared.gate is not None:
                gname = f"blk.{il}.ffn_gate_inp_shexp.weight"
                dshared = dy * shared.gate[:, None]
                dz = sigmoid_backward((dy * shared.out).sum(-1), shared.gate)      # (T,)
                dh = dh + dz[:, None] * params.weight(gname)[None, :]
                _add_full(grads, params, gname, shared.h.T @ dz)
            dh = dh + self._ffn_backward(dshared, shared.ffn, params, grads)
        return dh

    def _expert_names(self, il: int) -> list[str]:
        return [f"blk.{il}.ffn_{proj}_exps.weight" for proj in ("gate", "up", "down")]

    # ---- generation ---------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 64,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 adapter: LoraAdapter | None = None, adapter_scale: float = 1.0,
                 stop: Sequence[int] | None = None,
                 llamacpp_numerics: bool = True) -> Iterator[int]:
        """Yield new token ids one at a time (greedy when temperature is 0), with a KV cache.

        Stops after max_new_tokens, at a token in `stop` (default: the tokenizer's end-of-turn
        ids; the stop token itself is not yielded) or at the context length.
        llamacpp_numerics: as in `logits` (on: the CLI and the playground decode like llama.cpp).
        """
        return generate(self, prompt_ids, max_new_tokens, temperature, top_p, seed, adapter,
                        adapter_scale, stop, llamacpp_numerics)

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
                       temperature: float = 0.0, top_p: float = 1.0,
                       seeds: Sequence[int | None] | None = None,
                       adapter: LoraAdapter | None = None, adapter_scale: float = 1.0,
                       stop: Iterable[int] | None = None,
                       llamacpp_numerics: bool = False) -> list[list[int]]:
        """New token ids of every prompt, decoded together: sequence b gets what
        `generate(prompts[b], ..., seed=seeds[b], llamacpp_numerics=...)` yields, plus the stop
        token that ended it, if one did, as its last id. Repeated prompts (G samples of one
        prompt) are run once. llamacpp_numerics is off by default: GRPO samples with it and
        must sample from the plain float32 numerics that it trains.
        """
        return generate_batch(self, prompts, max_new_tokens, temperature, top_p, seeds, adapter,
                              adapter_scale, stop, llamacpp_numerics)


def _add_full(grads: Grads, params: Params, name: str, g) -> None:
    """Gradient of a tensor trained in full (norms, biases, router, ...); frozen ones get none."""
    if g is not None and params.trains(name):
        grads.add(name, g)


def _add_weight_grads(grads: Grads, name: str, dw, dlora) -> None:
    grads.add(name, dw)
    if dlora is not None:
        grads.add(name + ".lora_a", dlora[0])
        grads.add(name + ".lora_b", dlora[1])


def load_model(path: str | os.PathLike, cache_budget: int | None = None,
               device: str = "cpu") -> Model:
    """Open a GGUF model: validate the file, read its config, memory-map its weights.
    device "cuda" computes on the GPU with CuPy (app.engine.runtime.backend)."""
    return Model(read_gguf(path), cache_budget, device)
