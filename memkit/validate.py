"""Every command-line value checked at the boundary, before anything is launched or written.

Each check fails with one MemkitError line (what, the value, the fix; exit code 2). Three layers:

- argparse types (`harden`): every `type=int` flag takes ASCII digits only (Python's int()
  also accepts '١٢' and '1_000'), every `type=float` flag a finite number (float() accepts
  'nan' and 'inf', which would end up in ds_config.json as the non-JSON token NaN).
- ranges (`check_args`): one table of sane limits per flag, and the paths a command will write
  (--out, --plot, --output-dir, --report-json) probed before the work starts.
- the model and plan flags of `train`/`verify` (`check_run`, `check_model`), before any rank.
  plan.json documents are checked by memkit/plan/plan_schema.py wherever they are read.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from pathlib import Path

from memkit.errors import MemkitError

from memkit.plan.limits import LIMITS, MAX_GLOBAL_BATCH, MAX_SEQ_LEN, MAX_SYNTHETIC_TOKENS  # noqa: F401 (one table)
from memkit.plan.plan_schema import check_host  # noqa: F401 (one host-name rule; launch_script uses it too)
_SIZE_LIMITS = {"gpu_memory": (2**20, 2**44, "--gpu-memory", "1MiB and 16TiB"),  # bytes
                "host_ram": (2**20, 2**54, "--host-ram", "1MiB and 16PiB")}
_INT_RE = re.compile(r"[+-]?[0-9]{1,40}")
_FLOAT_RE = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,4})?")


# ---- argparse types --------------------------------------------------------------------------

def strict_int(text: str) -> int:
    """argparse type: an integer in ASCII digits ('8', not '٨', '1e3' or '1_000')."""
    raw = str(text).strip()
    if not _INT_RE.fullmatch(raw):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; write ASCII digits, e.g. 8")
    return int(raw)


def finite_float(text: str) -> float:
    """argparse type: a finite number in ASCII ('2e-5'; not 'nan', 'inf' or '٢')."""
    raw = str(text).strip()
    if not _FLOAT_RE.fullmatch(raw):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number; write e.g. 2e-5 or 0.1")
    value = float(raw)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is out of range for a number; write e.g. 2e-5 or 0.1")
    return value


def harden(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Swap int/float argument types for strict_int/finite_float in `parser` and its subparsers."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                harden(sub)
        elif action.type is int:
            action.type = strict_int
        elif action.type is float:
            action.type = finite_float
    return parser


# ---- ranges and paths ------------------------------------------------------------------------

def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_range(dest: str, value) -> None:
    lo, hi, what = LIMITS[dest]
    if isinstance(value, float) and not math.isfinite(value):
        raise MemkitError(f"{_flag(dest)} {value} is not a finite number; pass {what} between {lo:g} and {hi:g}")
    if lo <= value <= hi:
        return
    if isinstance(value, float) or isinstance(lo, float):
        raise MemkitError(f"{_flag(dest)} {value:g} must be between {lo:g} and {hi:g} ({what})")
    if value < lo and lo in (0, 1):
        kind = "a positive integer" if lo == 1 else "an integer >= 0"
        raise MemkitError(f"{_flag(dest)} {value} must be {kind} ({what}, at most {hi:,})")
    raise MemkitError(f"{_flag(dest)} {value} must be between {lo:,} and {hi:,} ({what})")


def check_args(args: argparse.Namespace) -> None:
    """Range- and path-check every flag `args` has; MemkitError on the first bad one."""
    command = getattr(args, "command", None)
    for dest, value in vars(args).items():  # the OS refuses such paths with a ValueError, not an OSError
        texts = value if isinstance(value, list) else [value]
        if any(isinstance(t, str) and "\x00" in t for t in texts):
            raise MemkitError(f"{_flag(dest)} contains a NUL byte; pass plain text")
    for dest in LIMITS:
        value = getattr(args, dest, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            check_range(dest, value)
    for dest in ("tp", "pp"):  # suggest takes 'auto' or a degree as text
        value = getattr(args, dest, None)
        if isinstance(value, str) and value.lower() != "auto":
            try:
                check_range(dest, strict_int(value))
            except argparse.ArgumentTypeError:
                raise MemkitError(f"{_flag(dest)} {value!r} must be a positive integer or 'auto'") from None
    for dest, (lo, hi, flag, span) in _SIZE_LIMITS.items():
        text = getattr(args, dest, None)
        if text:
            from memkit.units import parse_bytes

            if not lo <= parse_bytes(text, what=flag) <= hi:
                raise MemkitError(f"{flag} {text} is out of range; pass a size between {span}")
    headroom = getattr(args, "headroom", None)
    if isinstance(headroom, str) and not _FLOAT_RE.fullmatch(headroom.strip().rstrip("%").strip()):
        raise MemkitError(f"--headroom {headroom!r} is not a number; write e.g. 10% or 0.1")
    targets = getattr(args, "lora_targets", None)
    if targets is not None and not [t for t in targets.split(",") if t.strip()]:
        raise MemkitError(f"--lora-targets {targets!r} names no module; pass e.g. q_proj,v_proj "
                          "(or leave the flag out for the model's defaults)")
    steps = getattr(args, "max_steps", None)
    every = getattr(args, "eval_every", None)
    if isinstance(steps, int) and isinstance(every, int) and every > steps:
        raise MemkitError(f"--eval-every {every} is beyond the run's --max-steps {steps}; pass at most {steps} "
                          "(or 0 to evaluate at the end)")
    if getattr(args, "main_process_ip", None) is not None:
        check_host(args.main_process_ip, what="--main-process-ip")
    if command in ("suggest", "preset") and getattr(args, "out", None):
        from memkit.emit.bundle import check_target

        check_output_dir(args.out, what="--out")
        check_target(args.out, force=getattr(args, "force", False))  # before the search: nothing of theirs replaced
    if command == "launch-script":
        check_output_file(args.out, what="--out")
    if getattr(args, "plot", None):
        check_output_file(args.plot, what="--plot", suffixes=plot_formats())
    if getattr(args, "output_dir", None):
        check_output_dir(args.output_dir, what="--output-dir")
    if getattr(args, "report_json", None):
        check_output_file(args.report_json, what="--report-json")
    if getattr(args, "hostfile", None):
        from memkit.fileio import check_file

        check_file(args.hostfile, what="--hostfile")
    if getattr(args, "data", None) is not None and command in ("train", "verify", None):
        check_data(args.data, seq_len=getattr(args, "seq_len", None))
    if getattr(args, "resume", None) not in (None, "latest"):
        check_resume_path(args.resume)
    if command == "verify" and getattr(args, "model", None) is not None:
        check_model(args.model)


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _probe_writable(folder: Path, *, what: str, target) -> None:
    """Create and remove an empty temporary file in `folder`: the honest test (root ignores mode
    bits, and /proc or a read-only mount refuse writes whatever os.access says)."""
    try:
        fd, name = tempfile.mkstemp(prefix=".memkit-probe-", dir=folder)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise MemkitError(f"{what} {target}: cannot write in {folder} ({exc.strerror or exc}); "
                          "pick a writable path") from None


def check_output_dir(target: str, *, what: str) -> None:
    """A folder that exists (and is writable) or can be created."""
    path = Path(target)
    if path.exists() and not path.is_dir():
        raise MemkitError(f"{what} {target} is a file, not a folder; pick a folder path")
    base = _existing_ancestor(path)
    if not base.is_dir():
        raise MemkitError(f"{what} {target}: {base} is a file, so no folder can be made there; pick another path")
    _probe_writable(base, what=what, target=target)


def check_output_file(target: str, *, what: str, suffixes: tuple[str, ...] = ()) -> None:
    """A file path in an existing, writable folder (not a folder itself)."""
    path = Path(target)
    if suffixes and path.suffix.lower().lstrip(".") not in suffixes:
        raise MemkitError(f"{what} {target}: unknown file type {path.suffix or '(none)'!r}; use one of "
                          f"{', '.join('.' + s for s in suffixes)}")
    if path.is_dir():
        raise MemkitError(f"{what} {target} is a folder; give a file name")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise MemkitError(f"{what} {target}: folder {parent} does not exist; create it or pick another path")
    if path.exists() and not path.is_file():
        raise MemkitError(f"{what} {target} exists and is not a regular file; pick another path")
    _probe_writable(parent, what=what, target=target)


def plot_formats() -> tuple[str, ...]:
    """File types matplotlib writes without extra packages (backend_bases.FigureCanvasBase.filetypes)."""
    return ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "webp", "tif", "tiff")


def check_data(source: str, *, seq_len: int | None) -> None:
    """--data: synthetic[:N] with a sane N, a datasets folder, or a readable UTF-8 text file."""
    if not source.strip():
        raise MemkitError("--data is empty; pass a .jsonl, .txt, a datasets folder or 'synthetic'")
    if source == "synthetic" or source.startswith("synthetic:"):
        count = source.partition(":")[2]
        if count:
            if not _INT_RE.fullmatch(count) or int(count) < 1:
                raise MemkitError(f"--data {source}: N must be a positive integer in ASCII digits, e.g. synthetic:256")
            tokens = int(count) * (seq_len or 1)
            if tokens > MAX_SYNTHETIC_TOKENS:
                shape = f"{int(count):,} sequences" + (f" x {seq_len} tokens" if seq_len else "")
                raise MemkitError(f"--data {source}: {shape} is more than {MAX_SYNTHETIC_TOKENS:,} synthetic "
                                  "tokens held in memory; pass a smaller N")
        return
    path = Path(source)
    if path.is_dir():
        from memkit.train.records import DATASETS_MARKERS

        if not any((path / name).exists() for name in DATASETS_MARKERS):
            raise MemkitError(f"--data {source} is a folder but not a datasets folder (no "
                              f"{' / '.join(DATASETS_MARKERS)}); write it with Dataset.save_to_disk or pass a file")
        return
    if not path.exists():
        raise MemkitError(f"--data {source}: no such file or folder; pass a .jsonl, .txt, a datasets folder "
                          "(save_to_disk) or 'synthetic'")
    from memkit.fileio import check_file, check_text_file

    if path.suffix.lower() == ".parquet":  # binary by design: datasets reads it (train/records.py)
        check_file(path, what="--data")
    else:
        check_text_file(path, what="--data", fix="pass a .jsonl, .json, .csv, .parquet, .txt, a datasets "
                        "folder or 'synthetic'")
    if path.stat().st_size == 0:
        raise MemkitError(f"--data {source} is empty; it needs at least one record")


def check_resume_path(resume: str) -> None:
    """--resume PATH must be a published checkpoint folder (train/checkpoint.py verifies it in full)."""
    from memkit.train.checkpoint import STATE_FILE

    path = Path(resume)
    if not path.is_dir() or not (path / STATE_FILE).is_file():
        raise MemkitError(f"--resume {resume}: no checkpoint there (no folder with {STATE_FILE}); pass a "
                          "step-N folder under OUTPUT_DIR/checkpoints, or --resume alone for the newest")


# ---- train / finetune ----------------------------------------------------------------------------

def check_run(args: argparse.Namespace) -> None:
    """`train`'s plan flags against plan.json (or, without one, as a plan of their own), and the
    model's shape, before any launcher or rank starts (the ranks would find the same later)."""
    from memkit.plan.plan import TrainingPlan
    from memkit.train.config import check_flags, read_plan_file
    from memkit.train.main import plan_flags

    flags = plan_flags(args)
    if getattr(args, "plan", None):
        plan, _ = read_plan_file(args.plan)
        check_flags(plan, flags)
        check_launch_files(plan, plan_path=args.plan, config_file=getattr(args, "config_file", None))
    else:
        TrainingPlan(**{k: v for k, v in flags.items() if v is not None}).validate()
    if getattr(args, "model", None) is not None:
        check_model(args.model)


def check_launch_files(plan, *, plan_path: str | None, config_file: str | None):
    """The accelerate.yaml (--config-file, else beside plan.json) and the ds_config.json it names,
    checked against their schemas (memkit.plan.plan_schema) and against the plan, as the ranks would
    (memkit.train.config.resolve_plan), before anything starts. Returns (config path, accelerate
    dict, DeepSpeed path, DeepSpeed dict); Nones where there is no such file."""
    from memkit.cli.launching import accelerate_config_for, deepspeed_file, read_accelerate_config
    from memkit.fileio import read_json_object
    from memkit.plan.plan_schema import check_accelerate_config, check_deepspeed_config
    from memkit.train.config import resolve_plan

    path = accelerate_config_for(plan_path, config_file)
    if path is None:
        return None, None, None, None
    acc = read_accelerate_config(path)
    check_accelerate_config(acc, where=f"accelerate config {path}")
    ds_path = deepspeed_file(acc, path)
    ds = None
    if ds_path is not None:
        ds = read_json_object(ds_path, what="DeepSpeed config", fix="write the bundle again with memkit suggest --out",
                              noun="DeepSpeed config object")
        if plan is None or not _is_memkits_own(ds, plan):  # DeepSpeed's models cost its import (~10 s)
            check_deepspeed_config(ds, where=f"DeepSpeed config {ds_path}")
    if plan is not None:
        resolve_plan(plan=plan, flags={}, ds_config=ds, world_size=plan.num_gpus,
                     distributed_type=str(acc.get("distributed_type", "NO")), config_file_hint=str(ds_path))
    return path, acc, ds_path, ds


def _is_memkits_own(ds: dict, plan) -> bool:
    """True when ds_config.json is byte-for-byte what memkit writes for `plan` (memkit.emit.deepspeed,
    whose output DeepSpeed's own models accept: tests/unit/test_emit.py); only an edited or foreign
    file needs DeepSpeed's pydantic models, and so DeepSpeed's import."""
    import json

    from memkit.emit.deepspeed import deepspeed_config

    try:
        own = deepspeed_config(plan)
    except MemkitError:  # a plan without a DeepSpeed file: whatever is there is foreign
        return False
    # compared as JSON text: == on the parsed values would take 1 for true and 2.0 for 2
    return json.dumps(own, sort_keys=True) == json.dumps(ds, sort_keys=True)


def check_model(name: str) -> None:
    """The model a run will build: found as the runner finds it, and memkit's shape checks (hidden %
    heads, sizes) as `estimate` says them, for the families memkit knows; transformers checks the
    others when the run's prepare() builds the config."""
    from memkit.fileio import read_json_object
    from memkit.spec.hf import SUPPORTED_MODEL_TYPES, spec_from_config
    from memkit.train.model import resolve_model

    if not name.strip():
        raise MemkitError("--model is empty; pass a model folder, a config.json or a catalog name (memkit models)")
    source = resolve_model(name)
    config = read_json_object(source.config_path, what="config file", noun="config object")
    if not isinstance(config.get("model_type"), str):
        raise MemkitError(f"{source.config_path} has no 'model_type'; is it a transformers config.json?")
    if config["model_type"] in SUPPORTED_MODEL_TYPES:
        spec_from_config(config, name=name, config_path=str(source.config_path))
