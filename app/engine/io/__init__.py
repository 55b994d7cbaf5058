"""GGUF files: the ONLY code that imports `gguf`. Reading (memory-mapped, validated),
writing (atomic), quantizing and dequantizing tensors, ggml <-> numpy shape order.

May import: `runtime`, `kernels` (the dequantization kernels), `errors`.
"""
