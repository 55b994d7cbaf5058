"""Runs: the queue's jobs and the registered runs (`view.RunsView`)."""
