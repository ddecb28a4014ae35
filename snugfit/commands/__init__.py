"""CLI subcommands. Each module defines `add_parser(subparsers)` and `run(args) -> int`."""
