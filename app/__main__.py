"""`python -m app` == `workbench`: no arguments opens the GUI, subcommands run the CLI."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from app.cli.output import ensure_standard_streams

    ensure_standard_streams()  # `workbench ... >&-`: no file the app opens takes descriptor 1
    try:
        return _run(argv)
    except ModuleNotFoundError as e:  # a dependency missing before the CLI could say so
        from app.engine.errors import MissingModuleError

        missing = MissingModuleError.of(e)
        if missing is None:
            raise
        print(f"error: {missing.message}\nhint: {missing.hint}", file=sys.stderr)
        return 2


def _run(argv: list[str]) -> int:
    if not argv:
        from app.display_check import display_problem

        problem = display_problem()  # before Qt loads: Qt aborts (exit 134) without a window
        if problem:
            print(problem, file=sys.stderr)
            return 2
        from app.views.app import run_gui, sample_model_path

        return run_gui([sys.argv[0]], model_path=sample_model_path())
    from app.cli.main import run_cli

    return run_cli(argv)


if __name__ == "__main__":
    sys.exit(main())
