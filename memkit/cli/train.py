"""memkit train: `accelerate launch -m memkit.finetune` with the plan's accelerate config.

    memkit train --plan runs/x/plan.json --data train.jsonl --output-dir out/ --max-steps 200

is the same as

    accelerate launch --config_file runs/x/accelerate.yaml -m memkit.finetune \\
        --plan runs/x/plan.json --data train.jsonl --output-dir out/ --max-steps 200

The data, model and plan are checked here first, so a bad file is one line and exit code 2
before any process starts. Without an accelerate config (no --plan, no --config-file) the run
is a single plain process.
"""
from __future__ import annotations

import argparse
import sys

from memkit.cli.launching import (accelerate_config_for, child_env, launch_command, launchable_config, quote,
                                  to_argv)
from memkit.cli.supervise import SHUTDOWN_MARGIN_S, Supervisor, launcher_env

HELP = "fine-tune under a plan: accelerate launch -m memkit.finetune with the plan's config"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from memkit.train.main import add_arguments as finetune_arguments

    p.add_argument("--config-file", help="accelerate config (default: accelerate.yaml beside plan.json)")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    finetune_arguments(p)


def run(args: argparse.Namespace) -> int:
    from memkit.train.main import add_arguments as finetune_arguments
    from memkit.train.main import prepare

    from memkit.validate import check_run

    check_run(args)  # flags vs plan.json, the model's shape: before any process starts
    prepare(args, launched=False)  # raises MemkitError (one line, exit 2) on bad data/model/plan
    config_file = accelerate_config_for(args.plan, args.config_file)
    parser = argparse.ArgumentParser(add_help=False)
    finetune_arguments(parser)
    child_args = to_argv(parser._actions, args, skip=set())
    for required in ("--data", "--output-dir"):
        if required not in child_args:
            dest = required[2:].replace("-", "_")
            child_args += [required, str(getattr(args, dest))]
    if args.dry_run:
        print(quote(launch_command(config_file, child_args)))
        return 0
    with launchable_config(config_file) as launched:  # a preset's repository-relative paths, resolved
        cmd = launch_command(launched, child_args)
        print(f"memkit train: {quote(cmd)}", file=sys.stderr)
        sys.stderr.flush()
        # SIGTERM (a scheduler's preemption) / SIGINT / SIGUSR1 go to the launcher, which relays them to
        # the ranks; they checkpoint and stop; memkit then exits 143 / 130 / 138 (memkit.cli.supervise).
        grace = args.preempt_grace
        status, code = Supervisor(cmd, env=launcher_env(child_env(), preempt_grace_s=grace),
                                  grace_s=grace + 2 * SHUTDOWN_MARGIN_S).run()
    if status == "signal":
        print(f"memkit train: stopped by a signal (exit {code}); resume with --resume", file=sys.stderr)
    return int(code or 0)
