"""Runs as the GUI and the CLI see them: the run directory (the API between the window and
the engine), the reporter that records a run's events and status there (the worker's and the
foreground CLI's), the run kinds, the job queue (SQLite) and the worker process. The event
schema of metrics.jsonl is `app.engine.training.events` (the loops build their events with it).

May import: `training`, `data`, `model`, `text`, `io`, `runtime`, `errors`.
"""
