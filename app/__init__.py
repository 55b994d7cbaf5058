"""The workbench: fine-tune GGUF language models (Mixture-of-Experts first) on your workstation."""

import os

# Before NumPy loads OpenBLAS: its threads sleep at once after a GEMM instead of busy-waiting,
# which would take the core from the engine's own threads (app/engine/parallel.py).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

__version__ = "0.1.0"
