"""Exports users load elsewhere: GGUF LoRA adapters and merged models, PEFT folders, Ollama
Modelfiles, and their verification.

May import every engine package below it: `runs`, `training`, `data`, `model`, `text`, `io`,
`kernels`, `runtime`, `errors`.
"""
