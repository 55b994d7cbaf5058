"""Runs as the GUI and the CLI see them: the run directory (the API between the window and
the engine), the event schema of metrics.jsonl, the run kinds, the job queue (SQLite) and the
worker process.

May import: `training`, `data`, `model`, `text`, `io`, `runtime`, `errors`.
"""
