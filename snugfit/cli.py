"""`snugfit <command>`: every module in snugfit/commands with add_parser/run is a subcommand."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys

import snugfit.commands
from snugfit.errors import PeerFailed, SnugfitError, Stopped


class OneLineParser(argparse.ArgumentParser):
    """Bad command lines end with one line naming the problem, not a usage dump."""

    def error(self, message: str) -> None:
        sys.stderr.write(f"error: {message}; see `{self.prog} --help`\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="snugfit",
        description="Plan and run LLM training on the GPUs you have: profile the model, choose sharding, "
        "offload, recomputation and pipeline stages with a memory and time model, explain the choice, run it.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for info in sorted(pkgutil.iter_modules(snugfit.commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"snugfit.commands.{info.name}")
        if hasattr(module, "add_parser"):
            module.add_parser(sub).set_defaults(run=module.run)
    return parser


class _StdoutHandler(logging.StreamHandler):
    """Writes to sys.stdout as it is when a message is logged, not as it was when main() first ran: a caller that
    swaps it (pytest's capture, between two main() calls in one process) never leaves the logger a closed file.
    To sys.stderr where a command's stdout is a JSON document (`to_stderr`)."""

    to_stderr = False

    @property
    def stream(self):
        return sys.stderr if self.to_stderr else sys.stdout

    @stream.setter
    def stream(self, _):
        pass


def _setup_logging(rank: int) -> None:
    """snugfit's own messages on rank 0; libraries stay quiet."""
    logger = logging.getLogger("snugfit")
    if not logger.handlers:
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter("snugfit: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", "0"))
    _setup_logging(rank)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    # a command whose stdout is JSON (plan --json, profile-hardware) says everything else on stderr, while it runs
    _StdoutHandler.to_stderr = bool(getattr(args, "json", False) or getattr(args, "prints_json", False))
    try:
        if unknown:
            _refuse_unknown(parser, unknown, args.command)
        return args.run(args) or 0
    except Stopped as e:  # the state is saved: say where, no "error"
        if rank == 0:
            sys.stderr.write(f"{e}\n")
        return e.exit_status
    except PeerFailed:  # another rank printed the line
        return 2
    except SnugfitError as e:
        prefix = f"rank {rank}: " if "RANK" in os.environ and rank else ""
        sys.stderr.write(f"error: {prefix}{e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted; the last committed checkpoint is intact\n")
        return 130
    finally:
        _StdoutHandler.to_stderr = False


def _refuse_unknown(parser: argparse.ArgumentParser, unknown: list[str], command: str) -> None:
    """Name the first unknown option, with close matches among the command's own options and spellings, then
    (train, plan) among the config keys."""
    import difflib

    from snugfit.commands.options import ALIASES
    from snugfit.config import resolve_key

    option = next((u for u in unknown if u.startswith("-")), unknown[0])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    aliases = {s for spellings in ALIASES.values() for s in spellings}  # config keys the checks below don't know
    own = [s for a in sub._actions for s in a.option_strings if s.startswith("--") and ("." not in a.dest or s in aliases)]
    close = difflib.get_close_matches(option.split("=")[0], own, n=2, cutoff=0.8)
    if close:
        raise SnugfitError(f"unexpected argument {option!r}; did you mean {', '.join(close)}?")
    if command in ("train", "plan") and option.startswith("--"):
        resolve_key(option[2:].split("=")[0].replace("-", "_"))  # raises with suggestions when unknown
    raise SnugfitError(f"unexpected argument {option!r}; see `snugfit {command} --help`")


if __name__ == "__main__":
    sys.exit(main())
