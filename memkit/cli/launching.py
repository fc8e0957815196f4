"""What `memkit train`, `verify` and `launch-script` share: how the runner is started, which
accelerate config goes with a plan, and the `accelerate launch` command line."""
from __future__ import annotations

import contextlib
import os
import shlex
import sys
import tempfile
from pathlib import Path

from memkit.errors import MemkitError


def finetune_entry() -> list[str]:
    """The runner as a module (`python -m` / accelerate launch's -m): found through sys.path, so the
    command works from any directory and with a pip-installed memkit (no launch/ folder needed)."""
    return ["-m", "memkit.finetune"]


def plan_path(path: str | None) -> str | None:
    """--plan as given, or DIR/plan.json when it names a bundle folder (what `suggest --out` wrote)."""
    if path and Path(path).is_dir():
        return str(Path(path) / "plan.json")
    return path


def accelerate_config_for(plan_path: str | None, config_file: str | None) -> Path | None:
    """--config-file, else accelerate.yaml beside plan.json (what `memkit suggest --out` writes)."""
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise MemkitError(f"--config-file {config_file}: no such file")
        return path
    if plan_path:
        beside = Path(plan_path).parent / "accelerate.yaml"
        if beside.is_file():
            return beside
    return None


def read_accelerate_config(path: Path) -> dict:
    import yaml

    try:
        from memkit.fileio import read_text

        data = yaml.safe_load(read_text(path, what="accelerate config"))
    except yaml.YAMLError as exc:
        raise MemkitError(f"{path} is not YAML ({exc})") from None
    if not isinstance(data, dict):
        raise MemkitError(f"{path} is not an accelerate config (expected a mapping)")
    if not {"distributed_type", "compute_environment"} & set(data):  # what `accelerate config` always writes
        raise MemkitError(f"{path} is not an accelerate config (no distributed_type); pass the accelerate.yaml "
                          "that memkit suggest --out wrote")
    return data


def deepspeed_file(acc: dict, config_file: Path) -> Path | None:
    """The DeepSpeed file an accelerate config names, as an absolute path; None without one.

    accelerate reads deepspeed_config_file relative to the launching directory
    (accelerate/utils/launch.py: ACCELERATE_DEEPSPEED_CONFIG_FILE is the path as written). A bundle
    keeps its ds_config.json beside its accelerate.yaml, so a relative path that does not exist
    from here is that file (presets/ keep repository-relative paths: memkit.cli.preset)."""
    name = (acc.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if not name:
        return None
    path = Path(str(name)).expanduser()
    if path.is_absolute():
        return path
    if path.is_file():
        return path.resolve()
    beside = config_file.parent / path.name
    if beside.is_file():
        return beside.resolve()
    raise MemkitError(f"{config_file}: deepspeed_config_file {name} is neither under {Path.cwd()} nor beside the "
                      "accelerate config; fix the path in the YAML or write the bundle again with memkit suggest --out")


@contextlib.contextmanager
def launchable_config(config_file: Path | None):
    """`config_file`, or a temporary copy whose deepspeed_config_file is absolute when it names the
    file by a path relative to somewhere else (a preset launched from outside the repository)."""
    if config_file is None:
        yield None
        return
    import yaml

    acc = read_accelerate_config(config_file)
    ds_path = deepspeed_file(acc, config_file)
    if ds_path is None or str(ds_path) == str(acc["deepspeed_config"]["deepspeed_config_file"]):
        yield config_file
        return
    acc["deepspeed_config"]["deepspeed_config_file"] = str(ds_path)
    handle = tempfile.NamedTemporaryFile("w", prefix="memkit-accelerate-", suffix=".yaml", delete=False)
    try:
        with handle:
            yaml.safe_dump(acc, handle, sort_keys=False)
        yield Path(handle.name)
    finally:
        os.unlink(handle.name)


def launch_command(config_file: Path | None, finetune_args: list[str]) -> list[str]:
    """`accelerate launch --config_file X -m memkit.finetune ARGS`, or plain python without a config."""
    if config_file is None:
        return [sys.executable, *finetune_entry(), *finetune_args]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file),
            *finetune_entry(), *finetune_args]


def child_env() -> dict:
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def to_argv(parser_actions, args, *, skip: set[str]) -> list[str]:
    """Re-serialise the parsed flags that differ from their defaults (for the child command)."""
    out: list[str] = []
    for action in parser_actions:
        if not action.option_strings or action.dest in skip or action.dest == "help":
            continue
        value = getattr(args, action.dest, None)
        if value is None or value == action.default:
            continue
        flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
        if action.nargs == 0:  # store_true / store_const
            out.append(flag)
        elif value == action.const and action.nargs == "?":
            out.append(flag)
        else:
            out += [flag, str(value)]
    return out


def quote(args: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in args)
