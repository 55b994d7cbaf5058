"""A GGUF model: its config per architecture, the transformer's forward and backward, the
parameters a step reads (frozen quantized weights, LoRA adapters, trained tensors), the weight
store, generation, the model card and fresh models.

May import: `kernels`, `io`, `text`, `runtime`, `errors`.
"""
