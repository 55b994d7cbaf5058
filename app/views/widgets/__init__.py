"""Pieces shared by two or more screens, or generic: the error panel, form fields, plots,
tooltips, the live tail of a run and its checkpoints (best, final). Imports only `context` and
the engine's door; never a screen."""
