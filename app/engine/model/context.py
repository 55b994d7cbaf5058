"""The forward context: what every layer of one forward pass shares (positions, RoPE tables,
attention masks, packed segments, MoE routing counts) and where keys and values go while
decoding. The transformer walks its layers with one; generation subclasses it for a decoding
step (a KV cache)."""

from __future__ import annotations

import numpy as np

from app.engine.kernels.attention import attention_forward, attention_mask
from app.engine.kernels.rope import rope_angles
from app.engine.model.config import ModelConfig


class ForwardContext:
    """Per-forward constants shared by every layer: positions, RoPE tables, masks, and where
    keys and values go for decoding (app.engine.model.generation)."""

    def __init__(self, cfg: ModelConfig, q_pos, k_pos, segments, kv, xp=np):
        """q_pos, k_pos, segments: host arrays; the tables and masks are made on `xp`'s device."""
        self.cfg, self.q_pos, self.k_pos, self.segments, self.kv = cfg, q_pos, k_pos, segments, kv
        self.xp = xp
        self._rope: dict = {}
        self.routing: dict[int, np.ndarray] = {}  # MoE layer -> token slots per expert (E,)
        self._masks: dict = {}

    @classmethod
    def build(cls, cfg: ModelConfig, n_tokens: int, kv: list | None, positions=None,
              segments=None, xp=np) -> "ForwardContext":
        """kv: a list that collects each layer's (k, v) (prefilling a prompt), or None."""
        q_pos = np.arange(n_tokens) if positions is None else np.asarray(positions)
        return cls(cfg, q_pos, q_pos, None if segments is None else np.asarray(segments), kv, xp)

    def rope(self, swa: bool, dtype):
        """cos, sin (T, n_rot/2): SWA layers use rope.freq_base_swa and no frequency scaling."""
        key = (swa, np.dtype(dtype))
        if key not in self._rope:
            cfg = self.cfg
            base, scale = (cfg.rope_base_swa, 1.0) if swa else (cfg.rope_base, cfg.rope_freq_scale)
            self._rope[key] = rope_angles(self.xp, self.xp.asarray(self.q_pos), cfg.rope_dim, base,
                                          scale, dtype)
        return self._rope[key]

    def mask(self, swa: bool, dtype):
        """Additive (Tq, Tk) mask: causal, the sliding window on SWA layers, packed segments."""
        key = (swa, np.dtype(dtype))
        if key not in self._masks:
            window = self.cfg.sliding_window if swa else 0
            mask = attention_mask(np, self.q_pos, self.k_pos, window)           # (Tq, Tk)
            if self.segments is not None:
                mask = np.where(self.segments[:, None] != self.segments[None, :], -np.inf, mask)
            self._masks[key] = self.xp.asarray(mask.astype(dtype))              # made on the host
        return self._masks[key]

    def attend(self, il: int, q, k, v, swa: bool):
        """Layer il's attention of q (T, H, D) over this forward's k, v (T, Hkv, D):
        (out (T, H, Dv), cache for attention_backward)."""
        if self.kv is not None:
            self.kv.append((k, v))
        return attention_forward(q, k, v, self.cfg.attn_scale, self.mask(swa, q.dtype))
