"""The Evaluate screen: base and adapters on benchmark tasks and prompt suites, run by the
engine's worker through the queue (view.py)."""
