"""Monitor: the followed run's live curves, progress and log, GRPO's rewards and completions,
the comparison with other runs (`view.MonitorView`)."""
