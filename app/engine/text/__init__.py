"""Text in and out of a model: tokenizers with llama.cpp's pre-tokenizers and chat templates
(a sandboxed, budgeted jinja2).

May import: `io` (a GGUF's tokenizer metadata), `runtime`, `errors`.
"""
