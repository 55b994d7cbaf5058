"""Datasets: JSONL formats, loss masks, row weights, context windows, batches, the tokenized
cache and lint.

May import: `model` (tokenizer and config), `text`, `io`, `runtime`, `errors`.
"""
