"""DeepSpeed's compiled ops: which a plan needs, whether they are built, and build locks.

DeepSpeed compiles an op the first time it is used unless it was prebuilt at install
(`DS_BUILD_CPU_ADAM=1 pip install deepspeed`; deepspeed/git_version_info.py installed_ops):
OpBuilder.load -> jit_load -> torch.utils.cpp_extension.load (deepspeed/ops/op_builder/builder.py).
torch builds each extension in <extensions root>/<name>/ and caches <name>.so there; the root is
$TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/py<XY>_<cuZZZ|cpu>
(torch/utils/cpp_extension.py, _get_build_directory).

Concurrent builds are serialised by <build dir>/lock: the builder creates it with O_EXCL and
keeps the file descriptor open until it removes it (torch/utils/file_baton.py, FileBaton);
everyone else polls until the file is gone, without a timeout or a word. A build killed
mid-way leaves the file behind and every later launch waits forever. Because the holder keeps
the descriptor open, a lock no process has open (/proc/<pid>/fd) is stale. That check sees the
processes of this machine only (a home directory shared over NFS with a build on another node
looks stale here).

memkit never waits on a stale lock: `prepare_ops` (each rank, before any process group exists)
removes every stale lock under the extensions root with a line, announces each op it must build
(what, why, an estimate), and builds or loads the ops the run needs, so no rank waits in a
collective while another compiles. The extensions root is per install (`install_extensions_root`,
derived from sys.prefix) unless TORCH_EXTENSIONS_DIR is set: two virtual environments (another
torch, another ninja) never rebuild each other's ops.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from memkit.errors import MemkitError
from memkit.fileio import write_text_atomic
from memkit.plan.plan import TrainingPlan

OPS = {"cpu_adam": "CPUAdamBuilder", "fused_adam": "FusedAdamBuilder", "deepspeed_shm_comm": "ShareMemCommBuilder"}
"""DeepSpeed op NAME -> its builder class (deepspeed/ops/op_builder: cpu_adam.py, fused_adam.py;
cpu/comm.py ShareMemCommBuilder, which deepspeed/comm/torch.py build_shm_op loads for every
process group DeepSpeed starts on a CPU accelerator)."""
WHY = {"cpu_adam": "DeepSpeedCPUAdam, the optimizer step under optimizer offload",
       "fused_adam": "the AdamW optimizer block of the DeepSpeed config",
       "deepspeed_shm_comm": "DeepSpeed's shared-memory collectives between the CPU processes"}
BUILD_MINUTES = {"cpu_adam": 2, "fused_adam": 12, "deepspeed_shm_comm": 8}
"""First-build times shown before a build that has no measurement of its own yet: measured on
this project's 2-core CI machine with other jobs running (the last line of each op's .ninja_log,
in ms: cpu_adam 100 s, deepspeed_shm_comm 444 s, fused_adam 703 s), rounded up. Once memkit has built an op, the
measured time (BUILD_TIMES in the extensions root) is shown for the next build instead."""
BUILD_TIMES = "memkit-build-times.json"
STALE_RECHECK_S = 0.5
"""A lock seen without a holder is looked at again after this long: torch's FileBaton.release
closes the descriptor, then removes the file (torch/utils/file_baton.py), so a lock caught in
between is not stale; one still there, same inode, still unheld, is."""


def _default_root() -> Path:
    """torch's own default (torch/utils/cpp_extension.py, _get_build_directory)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def install_extensions_root() -> Path:
    """This install's extensions root: torch's default folder name plus a digest of sys.prefix
    (one per virtual environment or Python install)."""
    digest = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
    default = _default_root()
    return default.with_name(f"{default.name}-{digest}")


def use_install_extensions_dir() -> Path:
    """Point TORCH_EXTENSIONS_DIR at this install's root unless the user set it (torch reads it
    at every build: cpp_extension._get_build_directory); ops this same install already built in
    torch's shared default folder are copied over once (`_adopt_default_builds`). Returns the root."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        root = install_extensions_root()
        os.environ["TORCH_EXTENSIONS_DIR"] = str(root)
        _adopt_default_builds(_default_root(), root)
    return Path(os.environ["TORCH_EXTENSIONS_DIR"])


def _adopt_default_builds(default: Path, root: Path) -> None:
    """Copy each finished op build of torch's default root that this install made (its build.ninja
    compiles against this install's torch headers and Python) into `root`, so an existing cache is
    not rebuilt. A build made by another install, or one in progress (lock), is left alone."""
    import sysconfig

    import torch

    if not default.is_dir():
        return
    marks = (f"-isystem {Path(torch.__file__).parent / 'include'} ", f"-isystem {sysconfig.get_paths()['include']} ")
    for build in sorted(default.iterdir()):
        name = build.name
        if (root / name).exists() or (build / "lock").exists() or not (build / f"{name}.so").is_file():
            continue
        try:
            ninja = (build / "build.ninja").read_text()
        except OSError:
            continue
        if not all(mark in ninja for mark in marks):
            continue
        staging = root / f".adopting-{name}-{os.getpid()}"
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.copytree(build, staging, copy_function=shutil.copy2)  # mtimes kept: ninja sees it up to date
            os.rename(staging, root / name)
        except OSError:  # another rank adopted it first, or no room: torch builds it then
            shutil.rmtree(staging, ignore_errors=True)


def extensions_root() -> Path:
    """Where torch builds and caches extensions for memkit: $TORCH_EXTENSIONS_DIR, else this
    install's root (install_extensions_root)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else install_extensions_root()


@dataclass(frozen=True, slots=True, kw_only=True)
class BuildLock:
    path: Path
    age_s: float
    holders: tuple[int, ...] | None
    """PIDs with the lock file open; None where /proc cannot be read (not Linux)."""

    @property
    def stale(self) -> bool:
        return self.holders is not None and not self.holders

    def explain(self) -> str:
        op = self.path.parent.name
        if self.stale:
            return (f"stale build lock {self.path} ({self.age_s / 60:.0f} min old, no process has it open): "
                    f"a build of {op} was interrupted; every launch that needs {op} waits on it forever. "
                    f"Remove it: memkit doctor --clear-stale-locks (or rm {self.path})")
        if self.holders:
            return f"{op} is being built by process {', '.join(map(str, self.holders))} (lock {self.path})"
        return f"build lock {self.path} ({self.age_s / 60:.0f} min old; cannot tell whether a process holds it)"


def _holders(lock: Path) -> tuple[int, ...] | None:
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target = str(lock.resolve())
    found = []
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            fds = list((pid_dir / "fd").iterdir())
        except OSError:  # gone, or another user's process
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    found.append(int(pid_dir.name))
                    break
            except OSError:
                continue
    return tuple(found)


def find_locks(root: Path | None = None) -> list[BuildLock]:
    """Every <root>/<ext>/lock with its holders."""
    root = extensions_root() if root is None else root
    if not root.is_dir():
        return []
    now = time.time()
    out = []
    for lock in sorted(root.glob("*/lock")):
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:  # released while we looked
            continue
        out.append(BuildLock(path=lock, age_s=age, holders=_holders(lock)))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class OpState:
    name: str
    compatible: bool
    prebuilt: bool
    """Compiled at `pip install deepspeed` time (installed_ops)."""
    cached: bool
    """A JIT build of it is in the extensions cache (<root>/<name>/<name>.so)."""
    build_dir: Path
    lock: BuildLock | None

    @property
    def ready(self) -> bool:
        return self.prebuilt or self.cached


def op_state(name: str, root: Path | None = None) -> OpState:
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops

    root = extensions_root() if root is None else root
    builder = get_accelerator().create_op_builder(OPS[name])
    compatible = bool(builder is not None and builder.is_compatible(verbose=False))
    prebuilt = bool(installed_ops.get(name)) and accelerator_name == get_accelerator()._name
    build_dir = root / name
    lock_path = build_dir / "lock"
    lock = next((lk for lk in find_locks(root) if lk.path == lock_path), None) if lock_path.exists() else None
    return OpState(name=name, compatible=compatible, prebuilt=prebuilt,
                   cached=(build_dir / f"{name}.so").is_file(), build_dir=build_dir, lock=lock)


CPU_INFO_CACHE = "memkit-cpuinfo.json"
"""py-cpuinfo's answer for this machine, in the extensions root beside the ops it was asked for
(probe_cpu_once), under CPU_INFO_FIELDS' fingerprint."""
CPU_INFO_FIELDS = ("processor", "vendor_id", "cpu family", "model", "model name", "stepping", "microcode",
                   "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant", "CPU part",
                   "CPU revision", "isa", "cpu")
"""The /proc/cpuinfo lines a CPU's identity is read from (x86: vendor_id .. flags; arm64: Features and
the CPU id lines; ppc64/riscv: cpu, isa; Linux fs/proc and arch/*/kernel/cpuinfo): not "cpu MHz" or
"bogomips", which change while the machine runs."""


def _cpu_fingerprint() -> str | None:
    """A hash of this machine's CPU as Linux lists it (CPU_INFO_FIELDS) and of py-cpuinfo's release;
    None where /proc/cpuinfo cannot be read (then no answer is shared across processes)."""
    import platform

    import cpuinfo

    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None
    kept = [line for line in text.splitlines() if line.split(":", 1)[0].strip() in CPU_INFO_FIELDS]
    if not kept:
        return None
    digest = hashlib.sha256("\n".join([platform.machine(), str(getattr(cpuinfo, "CPUINFO_VERSION_STRING", "")),
                                        *kept]).encode())
    return digest.hexdigest()


def _shared_cpu_info(root: Path, ask):
    """`ask()`'s answer, read from root/CPU_INFO_CACHE when it was written for this machine's
    fingerprint, else asked and written there (atomically; a cache that cannot be read or written is
    asked around, never an error): every rank of every launch on one machine asks the same question."""
    key = _cpu_fingerprint()
    path = root / CPU_INFO_CACHE
    if key is not None:
        try:
            doc = json.loads(path.read_text())
            if doc.get("fingerprint") == key and isinstance(doc.get("info"), dict) and doc["info"]:
                return doc["info"]
        except (OSError, ValueError, AttributeError):
            pass
    info = ask()
    if key is not None and isinstance(info, dict) and info:  # py-cpuinfo answers {} when its probe failed
        try:
            root.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps({"fingerprint": key, "info": info}, sort_keys=True),
                              what="py-cpuinfo cache")
        except (OSError, TypeError, ValueError, MemkitError):
            pass
    return info


def probe_cpu_once(root: Path | None = None) -> None:
    """py-cpuinfo's answer cached for this process and, given the extensions root, for this machine.
    DeepSpeed's CPU op builders ask it twice per op load (deepspeed/ops/op_builder/builder.py,
    OpBuilder.cpu_arch and simd_width, which cpu/builder.py cxx_args calls on every jit_load, a
    cached build included), and py-cpuinfo answers each call by running itself in a fresh Python
    process, which runs CPUID in a multiprocessing child of its own (cpuinfo/cpuinfo.py,
    get_cpu_info -> get_cpu_info_json; _get_cpu_info_from_cpuid): 1.2 CPU s and 1.2 s wall a call,
    measured here (2026-12-06, `python -c "import cpuinfo; cpuinfo.get_cpu_info()"`), in every rank of
    every DeepSpeed launch. The CPU does not change under a running process, nor while /proc/cpuinfo
    reads the same (_shared_cpu_info). Each caller gets its own copy (cpu_arch edits the dict on
    aarch64); an exception is not cached. Idempotent."""
    try:
        import cpuinfo
    except ImportError:
        return  # DeepSpeed falls back to lscpu itself
    if hasattr(cpuinfo.get_cpu_info, "__wrapped__"):
        return
    probe = cpuinfo.get_cpu_info
    asked = functools.cache(probe if root is None else (lambda: _shared_cpu_info(root, probe)))

    @functools.wraps(probe)
    def get_cpu_info():
        return copy.deepcopy(asked())

    cpuinfo.get_cpu_info = get_cpu_info


def build_op(name: str) -> float:
    """Compile (or load) one op now, in this install's extensions root; returns the seconds it
    took (recorded there when it compiled, for the next estimate)."""
    from deepspeed.accelerator import get_accelerator

    root = use_install_extensions_dir()
    probe_cpu_once(root)
    was_cached = (root / name / f"{name}.so").is_file()
    start = time.perf_counter()
    get_accelerator().create_op_builder(OPS[name]).load(verbose=False)
    took = time.perf_counter() - start
    if not was_cached:
        _record_build_time(root, name, took)
    return took


def _record_build_time(root: Path, name: str, seconds: float) -> None:
    path = root / BUILD_TIMES
    try:
        times = json.loads(path.read_text()) if path.is_file() else {}
        times[name] = round(seconds, 1)
        write_text_atomic(path, json.dumps(times, indent=1, sort_keys=True), what="op build times")
    except (OSError, ValueError, TypeError, AttributeError, MemkitError):
        pass  # an estimate only


def build_estimate(name: str, root: Path | None = None) -> str:
    """'~N min' for a first build of `name`: memkit's last measured build here, else BUILD_MINUTES."""
    root = extensions_root() if root is None else root
    try:
        seconds = float(json.loads((root / BUILD_TIMES).read_text())[name])
        return f"~{max(1, round(seconds / 60))} min (measured here: {seconds:.0f} s)"
    except (OSError, ValueError, KeyError, TypeError):
        return f"~{BUILD_MINUTES[name]} min on a 2-core machine"


def clear_stale_locks(root: Path | None = None, *, say=None) -> list[Path]:
    """Remove every build lock under `root` that no process holds (looked at twice,
    STALE_RECHECK_S apart, same file); each removal said through `say`. Returns the removed."""
    root = extensions_root() if root is None else root
    removed = []
    for lock in find_locks(root):
        if not lock.stale:
            continue
        try:
            inode = lock.path.stat().st_ino
            time.sleep(STALE_RECHECK_S)
            if lock.path.stat().st_ino != inode or _holders(lock.path):
                continue
            lock.path.unlink()
        except FileNotFoundError:  # released or removed meanwhile
            continue
        removed.append(lock.path)
        if say is not None:
            say(f"removed stale build lock {lock.path} ({lock.age_s / 60:.0f} min old, no process has it "
                f"open: a build of {lock.path.parent.name} was interrupted); building it again")
    return removed


def ops_for(plan: TrainingPlan, ds_config: dict | None) -> list[str]:
    """The ops DeepSpeed will load for this plan (deepspeed/runtime/engine.py,
    get_optimizer_configuration: DeepSpeedCPUAdam under optimizer offload, else FusedAdam for an
    Adam(W) `optimizer` block without torch_adam)."""
    if ds_config is None or plan.optimizer != "adamw":
        return []
    if plan.offload_optimizer != "none":
        return ["cpu_adam"]
    block = ds_config.get("optimizer") or {}
    if str(block.get("type", "")).lower() in ("adam", "adamw") and not (block.get("params") or {}).get("torch_adam"):
        return ["fused_adam"]
    return []


def needed_ops(plan: TrainingPlan, ds_config: dict | None) -> list[str]:
    """Every op a DeepSpeed run of this plan loads: the optimizer's (ops_for) and, on a CPU
    accelerator, the shared-memory collectives DeepSpeed's process group loads."""
    if ds_config is None:
        return []
    from deepspeed.accelerator import get_accelerator

    offload = ((ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device")
    optimizer_ops = ops_for(plan, ds_config)
    if offload in ("cpu", "nvme") and plan.optimizer == "adamw":  # also a run from flags + this file
        optimizer_ops = ["cpu_adam"]

    shm = ["deepspeed_shm_comm"] if get_accelerator().create_op_builder(OPS["deepspeed_shm_comm"]) is not None else []
    return optimizer_ops + shm


def prepare_ops(plan: TrainingPlan, ds_config: dict | None, *, say: bool = True) -> list[str]:
    """Before any process group: this install's extensions root, every stale lock in it removed
    (a line each), a line per op that must be compiled (what, why, estimate), then every needed
    op built or loaded here. Every local rank calls it, `say` on local rank 0 only (it removes the
    stale locks and speaks): the first to take an op's lock builds, the others wait on that live
    lock and load the result, so none sits in a collective meanwhile. Returns the ops."""
    root = use_install_extensions_dir()
    names = [n for n in needed_ops(plan, ds_config) if op_state(n, root).compatible]
    if not names:
        return []

    def line(message: str) -> None:
        if say:
            print(f"memkit: {message}", file=sys.stderr, flush=True)

    if say:  # local rank 0 (the others meet a stale lock only by waiting on it until it is gone)
        clear_stale_locks(root, say=line)
    for name in names:
        state = op_state(name, root)
        if state.ready:
            continue
        if state.lock is not None and state.lock.holders:
            line(f"waiting: {state.lock.explain()}")
        else:
            line(f"building DeepSpeed {name} ({WHY[name]}; first use in this install), "
                 f"{build_estimate(name, root)}, cached in {state.build_dir}; `memkit doctor --build` "
                 "prebuilds it")
    for name in names:
        build_op(name)
    return names


def announce_builds(plan: TrainingPlan, ds_config: dict | None, *, say: bool = True) -> None:
    """prepare_ops for callers that hold a plan and a DeepSpeed config (kept for memkit verify/train)."""
    prepare_ops(plan, ds_config, say=say)
