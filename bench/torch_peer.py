"""The PyTorch peer: the same llama model (dense or MoE) and training step, eager float32 on the
CPU, written the way a competent PyTorch engineer would write it. Optional dev dependency
(`pip install -e '.[bench]'`).

- Weights come from the GGUF file through our reader into private float32 tensors (read with
  plain file reads, so no page of the file's mapping stays resident); quantized tensors are
  dequantized once with the engine's dequantizer, so on a Q8_0/Q4_K model the peer trains on
  the dequantized float32 weights (it keeps them, where ours keeps the quantized bytes).
- RMSNorm: F.rms_norm. RoPE: arch llama rotates adjacent pairs (ggml's NORM layout, see
  app/engine/kernels/rope.py), done as Meta's reference llama does it, a complex multiply;
  angles in float64 rounded to float32, as ours.
- Attention: F.scaled_dot_product_attention, causal, scale 1/sqrt(head_dim), with the kv heads
  repeated for GQA (query head h reads kv head h // group); on the CPU that is faster than
  SDPA's own enable_gqa (measured: 3.3 vs 5.1 ms at T=256, 72 vs 100 ms at T=1024).
- FFN: SwiGLU. MoE: softmax router over all experts, top-k, the k weights renormalised by
  max(sum, 6.1035e-5) when the architecture does (config.expert_weights_norm: llama/Mixtral
  yes, as app/engine/kernels/moe.py router_forward), sorted dispatch (stable argsort of the
  token slots by expert, one matmul per expert on its contiguous rows), the weighted combine
  with index_add_. Experts are separate per-expert tensors (as HF's Mixtral), so a trained
  expert gets its own weight gradient.
- LoRA: y = x W^T + s (x A^T) B^T with the adapter's A, B and s = alpha / r; the base is
  frozen (requires_grad False). Full fine-tuning: every F32/F16/BF16 tensor is trainable.
- Loss: F.cross_entropy over the (T, V) logits, labels -1 ignored. torch.nn.utils
  .clip_grad_norm_, then torch.optim.AdamW(fused=True), the fastest of its three CPU
  implementations here (LoRA 2.5 M params: 2.2 ms vs 4.7 for-loop, 7.3 foreach; full 12.9 M:
  12.5 vs 94 and 112 ms).
- Gradient checkpointing: torch.utils.checkpoint (non-reentrant) over segments of `interval`
  layers. Threads: torch.set_num_threads(the bench's thread count).
- Precision: float32, or with --precision bf16 torch.autocast("cpu", dtype=torch.bfloat16)
  around the forward and the loss (its linear layers and matmuls in bf16, cross-entropy in
  float32), the backward outside it: how a PyTorch user runs bf16 on a CPU with the units.

Only the llama architecture is implemented; other ones raise bench.train.Unsupported.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from app.engine.model.config import ModelConfig, config_from_metadata
from app.engine.io.gguf import dequantize, read_gguf
from app.engine.kernels.moe import RENORM_MIN
from app.engine.model.lora import LoraAdapter, init_adapter
from app.engine.runtime.timing import phase
from app.engine.model.params import TRAINABLE_TYPES
from bench.train import Unsupported, threads


def load_weights(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], set[str]]:
    """(config, float32 tensors by GGUF name in NumPy shape, names stored as F32/F16/BF16)."""
    f = read_gguf(path)
    try:
        cfg = config_from_metadata(f.metadata, f.tensors)
        infos = list(f.tensors.values())
    finally:
        f.close()
    if cfg.arch != "llama" or cfg.rope_dim != cfg.head_dim:
        raise Unsupported(f"the PyTorch peer implements arch llama (RoPE over the whole head) "
                          f"only, not this {cfg.arch} model")
    weights = {}
    for info in infos:
        raw = np.fromfile(path, np.uint8, count=info.nbytes, offset=info.offset)
        values = raw.view(np.float32) if info.ggml_type == 0 else \
            dequantize(raw.reshape(-1, info.row_bytes), info.ggml_type)
        weights[info.name] = torch.from_numpy(values.reshape(info.shape))
    return cfg, weights, {i.name for i in infos if i.ggml_type in TRAINABLE_TYPES}


def _per_expert(t: torch.Tensor) -> list[torch.Tensor]:
    """(E, ...) -> E separate leaf tensors (own storage each)."""
    return [x.clone() for x in t.unbind(0)]


class TorchPeer:
    """Llama (dense or MoE) forward in eager PyTorch over tensors named as in the GGUF file.

    params: name -> tensor, or a list of per-expert tensors for 3-D expert weights; lora: base
    name -> (A, B, scale) with A, B tensors or per-expert lists.
    """

    def __init__(self, path: str, adapter: LoraAdapter | None = None, full: bool = False,
                 checkpoint_interval: int = 0):
        self.cfg, weights, floats = load_weights(path)
        self.every = checkpoint_interval
        self.params = {n: _per_expert(w) if w.ndim == 3 else w for n, w in weights.items()}
        self.trained = sorted(floats) if full else []
        self.lora = {}
        for name, (a, b) in (adapter.tensors.items() if adapter else ()):
            if name == "token_embd.weight":
                raise Unsupported("the PyTorch peer has no LoRA on the token embedding")
            a, b = torch.tensor(a), torch.tensor(b)
            self.lora[name] = ((_per_expert(a), _per_expert(b)) if a.ndim == 3 else (a, b)) \
                + (adapter.scale(name),)
        for p in self.parameters():
            p.requires_grad_(True)

    def trainable(self) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """Trained tensors by our gradient names (<tensor>, <tensor>.lora_a / .lora_b)."""
        out = {n: self.params[n] for n in self.trained}
        for name, (a, b, _) in self.lora.items():
            out[name + ".lora_a"], out[name + ".lora_b"] = a, b
        return out

    def parameters(self) -> list[torch.Tensor]:
        return [p for t in self.trainable().values() for p in (t if isinstance(t, list) else [t])]

    def grads(self) -> dict[str, np.ndarray]:
        """The gradients after backward, by our gradient names, experts stacked (E, ...)."""
        stack = lambda t: torch.stack([p.grad for p in t]) if isinstance(t, list) else t.grad
        return {n: stack(t).numpy() for n, t in self.trainable().items()}

    # ---- forward ---------------------------------------------------------------------------
    def linear(self, name: str, x: torch.Tensor, expert: int | None = None) -> torch.Tensor:
        """x (n, in) -> (n, out): x W^T (+ s (x A^T) B^T)."""
        pick = (lambda t: t) if expert is None else (lambda t: t[expert])
        y = F.linear(x, pick(self.params[name]))
        if name in self.lora:
            a, b, s = self.lora[name]
            y = y + s * F.linear(F.linear(x, pick(a)), pick(b))
        return y

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, x.shape[-1:], self.params[name], self.cfg.rms_eps)

    def rope_table(self, n_tokens: int) -> torch.Tensor:
        """(T, D/2) complex64: e^(i pos theta_j), theta_j = base^(-2j/D) (x freq scale)."""
        cfg = self.cfg
        pairs = torch.arange(0, cfg.rope_dim, 2, dtype=torch.float64)
        inv = cfg.rope_base ** (-pairs / cfg.rope_dim)                               # (D/2,)
        theta = torch.arange(n_tokens, dtype=torch.float64)[:, None] * cfg.rope_freq_scale * inv
        return torch.complex(theta.cos().float(), theta.sin().float())

    @staticmethod
    def rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """x (T, H, D): adjacent pairs (2j, 2j+1) rotated as complex numbers."""
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))            # (T, H, D/2)
        return torch.view_as_real(xc * table[:, None, :]).flatten(-2)          # (T, H, D)

    def attention(self, p: str, h: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        cfg, t = self.cfg, h.shape[0]
        q = self.linear(p + "attn_q.weight", h).view(t, cfg.n_head, cfg.head_dim)
        k = self.linear(p + "attn_k.weight", h).view(t, cfg.n_head_kv, cfg.head_dim)
        v = self.linear(p + "attn_v.weight", h).view(t, cfg.n_head_kv, cfg.head_dim)
        q, k = self.rope(q, table), self.rope(k, table)
        group = cfg.n_head // cfg.n_head_kv
        out = F.scaled_dot_product_attention(                                  # (H, T, D)
            q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(group, 0),
            v.transpose(0, 1).repeat_interleave(group, 0), is_causal=True, scale=cfg.attn_scale)
        return self.linear(p + "attn_output.weight", out.transpose(0, 1).reshape(t, -1))

    def ffn(self, pattern: str, h: torch.Tensor, expert: int | None = None) -> torch.Tensor:
        gate = self.linear(pattern.format("gate"), h, expert)                  # (n, F)
        up = self.linear(pattern.format("up"), h, expert)                      # (n, F)
        return self.linear(pattern.format("down"), F.silu(gate) * up, expert)  # (n, C)

    def moe(self, p: str, h: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        probs = self.linear(p + "ffn_gate_inp.weight", h).softmax(-1)           # (T, E)
        weights, selected = probs.topk(cfg.n_expert_used, dim=-1)              # (T, K)
        if cfg.expert_weights_norm:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(RENORM_MIN)
        slots = selected.flatten()                                             # (T*K,)
        order = slots.argsort(stable=True)                                     # slots by expert
        token_of = order // cfg.n_expert_used                                  # (T*K,)
        counts = torch.bincount(slots, minlength=cfg.n_expert).tolist()
        xs = h[token_of].split(counts)                                         # (n_e, C) each
        ys = torch.cat([self.ffn(p + "ffn_{}_exps.weight", x, e) for e, x in enumerate(xs)])
        ys = ys * weights.flatten()[order, None]                               # (T*K, C)
        # under autocast ys is bf16 and h float32: index_add_ wants one type (the sum in h's)
        return torch.zeros_like(h).index_add_(0, token_of, ys.to(h.dtype))    # (T, C)

    def block(self, il: int, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        p = f"blk.{il}."
        x = x + self.attention(p, self.norm(p + "attn_norm.weight", x), table)
        h = self.norm(p + "ffn_norm.weight", x)
        if self.cfg.layer_is_moe(il):
            return x + self.moe(p, h)
        return x + self.ffn(p + "ffn_{}.weight", h)

    def segment(self, start: int, stop: int, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        for il in range(start, stop):
            x = self.block(il, x, table)
        return x

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (T,) -> final hidden states (T, C), checkpointed per segment when training."""
        x = F.embedding(tokens, self.params["token_embd.weight"])              # (T, C)
        table = self.rope_table(tokens.shape[0])
        n = self.cfg.n_layer
        if not (self.every and torch.is_grad_enabled()):
            return self.segment(0, n, x, table)
        for start in range(0, n, self.every):
            x = checkpoint(self.segment, start, min(start + self.every, n), x, table,
                           use_reentrant=False)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden states (T, C) -> logits (T, V) (a tied head has no LoRA, as ours)."""
        h = self.norm("output_norm.weight", x)
        if self.cfg.tied_output:
            return F.linear(h, self.params["token_embd.weight"])
        return self.linear("output.weight", h)

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(self.hidden(tokens)), labels, ignore_index=-1)


def autocast_precision(requested: str):
    """The peer's precision for the row's --precision: bf16 (torch.autocast) or fp32; auto is
    what ours would choose on this CPU (app.engine.runtime.bf16.choose)."""
    from app.engine.runtime.bf16 import Precision, choose

    if requested == "auto":
        requested = choose("auto").name
    if requested == "bf16":
        return Precision("bf16", "autocast", "bf16: torch.autocast('cpu', dtype=torch.bfloat16)")
    return Precision("fp32", None, "float32")


class TorchTrainer:
    """The peer's training step behind the interface bench.train.measure times."""

    dequant_seconds = 0.0    # weights are dequantized once at load

    def __init__(self, w):
        torch.set_num_threads(threads())
        config = w.train_config()
        adapter = None
        if w.mode == "lora":
            from app.engine.io.gguf import read_gguf

            f = read_gguf(w.model)
            shapes = {n: t.shape for n, t in f.tensors.items()}
            arch = f.metadata["general.architecture"]
            f.close()
            adapter = init_adapter(shapes, arch, w.lora_config())
        self.peer = TorchPeer(w.model, adapter, full=w.mode == "full",
                              checkpoint_interval=w.checkpoint)
        self.params = self.peer.parameters()
        self.n_trainable = sum(p.numel() for p in self.params)
        self.n_vocab = self.peer.cfg.n_vocab
        self.max_grad_norm = config.max_grad_norm
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
            weight_decay=config.weight_decay, fused=True)
        self.precision = autocast_precision(w.precision)

    def _autocast(self):
        """torch.autocast on the CPU in bf16 when the row asks for bf16 (the backward runs
        outside it, as PyTorch recommends), else nothing."""
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.precision.bf16)

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.peer.logits(self.peer.hidden(torch.from_numpy(tokens))).numpy()

    def batch(self, window: np.ndarray):
        return torch.from_numpy(window[:-1]), torch.from_numpy(window[1:])

    def step(self, batch) -> float:
        tokens, labels = batch
        with self._autocast(), phase("forward"):
            x = self.peer.hidden(tokens)
        with self._autocast(), phase("loss"):
            loss = F.cross_entropy(self.peer.logits(x), labels, ignore_index=-1)
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.item()
