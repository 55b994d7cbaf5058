"""The workbench: fine-tune GGUF language models (Mixture-of-Experts first) on your workstation."""

__version__ = "0.1.0"
