"""`memkit` entry point: dispatch to one module per subcommand; user errors become one line.

Each subcommand module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`.
Exit codes: 0 ok, 2 bad input (MemkitError), 3 no plan fits (NoFeasiblePlan).

Only the subcommand that runs is imported (its module pulls in the estimator, the planner or the
runner); `memkit --help` reads each module's one-line HELP from its source, so it imports none.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from memkit.errors import MemkitError

COMMANDS = {
    "estimate": "memkit.cli.estimate",
    "models": "memkit.cli.models",
    "gpus": "memkit.cli.gpus",
    "suggest": "memkit.cli.suggest",
    "explain": "memkit.cli.explain",
    "verify": "memkit.cli.verify",
    "train": "memkit.cli.train",
    "run": "memkit.cli.run",
    "launch-script": "memkit.cli.launch_script",
    "doctor": "memkit.cli.doctor",
    "preset": "memkit.cli.preset",
    "calibrate": "memkit.cli.calibrate",
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line and exit code 2 (its own default is also 2)."""

    def error(self, message):  # noqa: D401 - argparse API
        sys.stderr.write(f"memkit: error: {message}\n")
        raise SystemExit(2)


def _help_line(module_name: str) -> str | None:
    """The module's `HELP = "..."` line read from its source without importing it (a literal on
    one line); None when it is not there in that form (then the module is imported), or when the
    subcommand does not exist."""
    import ast
    from importlib.util import find_spec

    spec = find_spec(module_name)
    if spec is None or not spec.origin:
        return None
    try:
        with open(spec.origin, encoding="utf-8") as f:
            for line in f:
                if line.startswith("HELP = "):
                    return ast.literal_eval(line[len("HELP = "):].strip())
    except (OSError, ValueError, SyntaxError):
        pass
    return None


def _selected(argv: list[str]) -> str | None:
    """The subcommand named on the command line (argparse takes the first positional)."""
    for token in argv:
        if token == "--":
            return None
        if not token.startswith("-"):
            return token if token in COMMANDS else None
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with `argv`, only the subcommand it names gets its arguments (and is imported),
    the others are listed by their HELP line. Without `argv`, every subcommand is built."""
    chosen = _selected(argv) if argv is not None else None
    parser = _Parser(prog="memkit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, module_name in COMMANDS.items():
        help_line = _help_line(module_name) if argv is not None and name != chosen else None
        if help_line is not None:
            sub.add_parser(name, help=help_line, description=help_line)
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # subcommand not built yet
            raise
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    if chosen is None and argv is not None:
        return parser  # no typed flag to harden: the top-level help
    from memkit.validate import harden

    return harden(parser)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    from memkit.validate import check_args

    try:
        check_args(args)  # ranges, paths, data: before anything is launched or written
        return int(args._run(args) or 0)
    except MemkitError as exc:
        sys.stderr.write(f"memkit: error: {' '.join(str(exc).split())}\n")  # one line, always
        return exc.exit_code
    except BrokenPipeError:  # `memkit ... | head`
        sys.stderr.close()
        return 0
    except OSError as exc:  # the file system said no after the checks (disk full, a race): one line
        where = f"{exc.filename}: " if exc.filename else ""
        sys.stderr.write(f"memkit: error: {where}{exc.strerror or exc}; check the path, its permissions "
                         "and free space\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("memkit: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
