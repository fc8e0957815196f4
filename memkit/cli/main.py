"""`memkit` entry point: dispatch to one module per subcommand; user errors become one line.

Each subcommand module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`.
Exit codes: 0 ok, 2 bad input (MemkitError), 3 no plan fits (NoFeasiblePlan).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from memkit.validate import check_args, harden
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memkit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # subcommand not built yet
            raise
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return harden(parser)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
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
