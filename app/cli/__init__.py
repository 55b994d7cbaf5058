"""The `workbench` command line: argparse subcommands, thin (parse, call the engine, print).

`main` holds the parser, the dispatch and the light commands; `train` and `grpo` the training
commands. May import the engine's public modules, never Qt.
"""
