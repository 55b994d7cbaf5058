"""What a forward pass reads: frozen base weights, fully trained tensors and LoRA pairs.

`Params` is the one place that decides, per tensor name, where the numbers come from:
- a fully trained tensor (`full[name]`, a float32 master copy that the optimizer updates),
- else the frozen base weight from the memory-mapped file (dequantized when used),
and whether a LoRA pair applies to it (`adapter`). Gradient names follow the GGUF adapter
format: `<tensor>` for a full tensor, `<tensor>.lora_a` / `<tensor>.lora_b` for LoRA.

It also decides what a base weight multiplies (`base_input`): with `llamacpp_numerics` the
activations rounded as llama.cpp's CPU backend rounds them for the weight's stored type
(Q8_0/Q8_1/Q8_K/F16, app.engine.kernels.act_quants), so that inference logits match
llama.cpp's to ~1e-6 on quantized models; without it plain float32. It is on for what a user
reads (Model.logits, Model.generate: the CLI, the playground) and off for everything that
trains or samples for training (TrainSession, GRPO's Model.generate_batch and log-probs):
a quantizer has no useful gradient, and GRPO samples from the numerics it trains.
"""

from __future__ import annotations

import zlib

import numpy as np

from app.engine.kernels.act_quants import quantize_activations
from app.engine.model.lora import LoraAdapter
from app.engine.model.weights import PackedExperts, WeightStore
from app.engine.runtime.bf16 import FP32, Precision, pack

TRAINABLE_TYPES = (0, 1, 30)  # F32, F16, BF16: quantized tensors stay frozen (stop-gradient)


class _Cast:
    """An expert- or row-indexable lazy view whose items are cast to the compute dtype."""

    def __init__(self, view, dtype):
        self.view, self.dtype, self.shape = view, dtype, view.shape

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index):
        return self.view[index].astype(self.dtype, copy=False)


class Params:
    def __init__(self, store: WeightStore, dtype=np.float32, full: dict | None = None,
                 adapter: LoraAdapter | None = None, adapter_scale: float = 1.0,
                 training: bool = False, llamacpp_numerics: bool = False):
        if training and llamacpp_numerics:
            raise ValueError("llamacpp_numerics is for inference: training computes in float32")
        self.store = store
        self.dtype = np.dtype(dtype)
        self.full = full or {}
        self.adapter = adapter
        self.adapter_scale = adapter_scale
        self.training = training  # exact GELU instead of ggml's fp16 table (differentiable)
        self.llamacpp_numerics = llamacpp_numerics  # see base_input
        self.lora_dropout = 0.0
        self.dropout_seed: tuple[int, ...] = (0,)  # set per micro-batch by the trainer
        # The frozen base's products in bf16 or float32 (app.engine.runtime.bf16): set by the
        # trainer from the run's `precision`; inference stays float32.
        self.precision: Precision = FP32
        self._packed_full: dict = {}    # trained tensors rounded to bf16 for one pass
        # Frozen tensors whose products stay float32 under bf16: a preference run's reference
        # computes each tensor as its policy does (app.engine.training.preference), and full
        # fine-tuning computes its trained 3-D experts in float32 (only 2-D matrices get a bf16
        # copy per pass).
        self.float32_names: frozenset[str] = frozenset()

    def has(self, name: str) -> bool:
        return name in self.full or name in self.store

    def trains(self, name: str) -> bool:
        return name in self.full

    def weight(self, name: str):
        if name in self.full:
            return self.full[name]
        return self.store.get(name).astype(self.dtype, copy=False)

    def _in_bf16(self, name: str) -> bool:
        """A frozen base weight whose products run in bf16: under precision bf16, every matrix
        read from the file but the router's (its logits pick the experts: float32)."""
        return (self.precision.bf16 and name not in self.full and name not in self.float32_names
                and "ffn_gate_inp" not in name and len(self.store.shape(name)) >= 2)

    def _full_in_bf16(self, name: str) -> bool:
        """A fully trained matrix whose products run in bf16 (its float32 master copy is what
        the optimizer updates): 2-D, not the router's, on the CPU."""
        return (self.precision.bf16 and name in self.full and self.full[name].ndim == 2
                and "ffn_gate_inp" not in name and isinstance(self.full[name], np.ndarray))

    def computes_in_bf16(self, name: str) -> bool:
        """Whether the products of tensor `name` run in bf16 in this pass's forward."""
        return self._in_bf16(name) or self._full_in_bf16(name)

    def _packed_master(self, name: str):
        """The bf16 copy of a trained matrix for this pass, made at its first use in the pass."""
        w = self._packed_full.get(name)
        if w is None:
            w = self._packed_full[name] = pack(self.full[name], self.precision.backend)
        return w

    def forget_packed(self) -> None:
        """Drop the bf16 copies of the trained tensors: called at the start of every forward and
        backward pass (Model.loss_and_grads) and after every optimizer step (TrainSession),
        the times the float32 masters may have changed."""
        self._packed_full.clear()

    def base_weight(self, name: str):
        """`weight(name)` for a linear layer's base product (app.engine.kernels.linear): a
        Bf16Weight where `_in_bf16` (the cache's) or `_full_in_bf16` (this pass's), else the
        float32 array."""
        if self._in_bf16(name):
            return self.store.packed(name, self.precision.backend)
        if self._full_in_bf16(name):
            return self._packed_master(name)
        return self.weight(name)

    def experts(self, name: str):
        if name in self.full:
            return self.full[name]
        if self._in_bf16(name):
            return PackedExperts(self.store, name, self.precision.backend)
        view = self.store.experts(name)
        return view if self.dtype == np.float32 else _Cast(view, self.dtype)

    def row_view(self, name: str):
        """A 2-D tensor read by row slices (the loss head): see WeightStore.row_view."""
        if self._full_in_bf16(name):
            return self._packed_master(name)
        if name in self.full:
            return self.full[name]
        if self._in_bf16(name):
            return self.store.packed(name, self.precision.backend)
        view = self.store.row_view(name)
        if isinstance(view, np.ndarray):
            return view.astype(self.dtype, copy=False)
        return view if self.dtype == np.float32 else _Cast(view, self.dtype)

    def base_input(self, name: str, x):
        """What the base weight `name` multiplies, for activations x (..., in): with
        llamacpp_numerics and a weight read from the file, x rounded to the activation type of
        the weight's stored GGML type (a new array, or x itself for F32); else x itself (a
        trained tensor in `full` is float32). LoRA branches always read x: llama.cpp's adapters
        are float32."""
        if not self.llamacpp_numerics or name in self.full:
            return x
        return quantize_activations(x, self.store.gguf.tensors[name].ggml_type)

    def rows(self, name: str, index: np.ndarray):
        if name in self.full:
            return self.full[name][self.store.xp.asarray(index)]
        return self.store.rows(name, index).astype(self.dtype, copy=False)

    def lora(self, name: str):
        if self.adapter is None:
            return None
        pair = self.adapter.scaled(name, self.adapter_scale)
        if pair is None:
            return None
        a, b, s = pair
        return a.astype(self.dtype, copy=False), b.astype(self.dtype, copy=False), s


    def dropout_mask(self, name: str, shape, dtype):
        """LoRA dropout keep-mask scaled by 1/(1-p), or None (off, or not training).

        Drawn from (dropout_seed, tensor name), so recomputing a layer under gradient
        checkpointing reproduces exactly the same mask."""
        p = self.lora_dropout
        if not self.training or p <= 0.0:
            return None
        rng = np.random.default_rng([*self.dropout_seed, zlib.crc32(name.encode())])
        mask = (rng.random(shape) >= p).astype(dtype) / dtype.type(1.0 - p)
        return self.store.xp.asarray(mask)  # drawn on the host: the same masks on any device


class Grads(dict):
    """Gradient accumulator by name: adding to a name twice sums (tied weights, fan-out)."""

    def add(self, name: str, g) -> None:
        if g is None:
            return
        if name in self:
            self[name] = self[name] + g
        else:
            self[name] = g
