"""The window (Qt only): the shell at this level, one package per screen, shared widgets.

`app` starts the application, `main_window` assembles the screens (it alone may import them),
`context` is the `AppContext` every screen is built around. Each screen is a package whose
`view.py` holds the screen's class: new_run, monitor, runs, experts, playground, export,
settings. A screen imports only `widgets` (pieces shared by two or more screens, or generic),
`context` and the engine's door `app.engine.api`; screens never import each other (an
import-linter contract in pyproject.toml), they talk through the context's signals.
"""
