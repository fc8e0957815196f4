"""memkit train: `accelerate launch -m memkit.finetune` with the plan's accelerate config.

    memkit train --plan runs/x/plan.json --data train.jsonl --output-dir out/ --max-steps 200

is the same as

    accelerate launch --config_file runs/x/accelerate.yaml -m memkit.finetune \\
        --plan runs/x/plan.json --data train.jsonl --output-dir out/ --max-steps 200

The data, model and plan are checked here first, so a bad file is one line and exit code 2
before any process starts. Without an accelerate config (no --plan, no --config-file) the run
is a single plain process. An error a worker finds later (its `finetune: error: ...` line) is
shown as that one line, exit 2, without the launcher's traceback that follows it
(`WorkerErrors`). --plan takes plan.json or the bundle folder that holds it.
"""
from __future__ import annotations

import argparse
import sys

from memkit.cli.launching import (accelerate_config_for, child_env, launch_command, launchable_config, quote,
                                  to_argv)
from memkit.train.supervise import SHUTDOWN_MARGIN_S, Supervisor, launcher_env

HELP = "fine-tune under a plan: accelerate launch -m memkit.finetune with the plan's config"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from memkit.train.main import add_arguments as finetune_arguments

    p.add_argument("--config-file", help="accelerate config (default: accelerate.yaml beside plan.json)")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    add_port_argument(p)
    finetune_arguments(p)


def add_port_argument(p: argparse.ArgumentParser) -> None:
    """--main-process-port for `train` and `verify`: accelerate launch's --main_process_port (the
    rendezvous port of process 0; accelerate/commands/launch.py, launch_command_parser)."""
    p.add_argument("--main-process-port", type=int, metavar="PORT",
                   help="rendezvous port of process 0 (accelerate launch --main_process_port; default: "
                        "accelerate.yaml's, else 29500); pick a free one when another job holds it")


def with_port(cmd: list[str], port: int | None) -> list[str]:
    """`cmd` (launching.launch_command) with --main_process_port after accelerate's --config_file."""
    if port is None or "--config_file" not in cmd:
        return cmd
    at = cmd.index("--config_file") + 2
    return cmd[:at] + ["--main_process_port", str(port)] + cmd[at:]


MARKERS = ((b"finetune: error: ", 2), (b"finetune: out of memory", 3))
"""A worker's one-line reports (memkit.train.main.main) and the exit code memkit gives for each."""


class WorkerErrors:
    """Reads the launcher's stderr and passes it through as it comes (progress bars included),
    until a worker's one-line report (MARKERS): that line is kept, everything after it (the
    launcher's traceback of the failed child, torchrun's error banner) is dropped."""

    def __init__(self, sink) -> None:
        self.sink, self.line, self.exit_code = sink, None, None

    def __call__(self, pipe) -> None:
        import os

        fd, pending = pipe.fileno(), b""
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            if self.line is not None:
                continue  # the report is in: drain the rest unseen
            pending += chunk
            for marker, code in MARKERS:
                at = pending.find(marker)
                if at >= 0:
                    end = pending.find(b"\n", at)
                    if end < 0:
                        break  # the line is not complete yet
                    self._write(pending[:at])
                    self.line = pending[at + len(b"finetune: "):end].decode("utf-8", "replace").strip()
                    self.exit_code = code
                    pending = b""
                    break
            else:
                cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
                self._write(pending[:cut])
                pending = pending[cut:]
        if self.line is None:
            self._write(pending)

    def _write(self, data: bytes) -> None:
        if data:
            self.sink.write(data)
            self.sink.flush()


def run(args: argparse.Namespace) -> int:
    check(args)
    return launch(args)


def check(args: argparse.Namespace) -> None:
    """Everything `run` checks before a process starts; MemkitError (one line, exit 2) on the first
    bad value (`memkit run` calls it before it writes the bundle)."""
    from memkit.cli.launching import plan_path
    from memkit.train.main import prepare
    from memkit.validate import check_run

    args.plan = plan_path(args.plan)
    check_run(args)  # flags vs plan.json, the model's shape: before any process starts
    prepare(args, launched=False)  # raises MemkitError (one line, exit 2) on bad data/model/plan


def launch(args: argparse.Namespace) -> int:
    """Start the processes of a checked `args` (`check`) and wait for them."""
    from memkit.train.main import add_arguments as finetune_arguments

    config_file = accelerate_config_for(args.plan, args.config_file)
    parser = argparse.ArgumentParser(add_help=False)
    finetune_arguments(parser)
    child_args = to_argv(parser._actions, args, skip=set())
    for required in ("--data", "--output-dir"):
        if required not in child_args:
            dest = required[2:].replace("-", "_")
            child_args += [required, str(getattr(args, dest))]
    if args.dry_run:
        print(quote(with_port(launch_command(config_file, child_args), args.main_process_port)))
        return 0
    errors = WorkerErrors(sys.stderr.buffer)
    with launchable_config(config_file) as launched:  # a preset's repository-relative paths, resolved
        cmd = with_port(launch_command(launched, child_args), args.main_process_port)
        print(f"memkit train: {quote(cmd)}", file=sys.stderr)
        sys.stderr.flush()
        # SIGTERM (a scheduler's preemption) / SIGINT / SIGUSR1 go to the launcher, which relays them to
        # the ranks; they checkpoint and stop; memkit then exits 143 / 130 / 138 (memkit.train.supervise).
        grace = args.preempt_grace
        status, code = Supervisor(cmd, env=launcher_env(child_env(), preempt_grace_s=grace),
                                  grace_s=grace + 2 * SHUTDOWN_MARGIN_S, stderr_reader=errors).run()
    if status == "signal":
        print(f"memkit train: stopped by a signal (exit {code}); resume with --resume", file=sys.stderr)
        return int(code or 0)
    if errors.line is not None and code:
        print(f"memkit: {errors.line}", file=sys.stderr)
        return errors.exit_code
    return int(code or 0)
