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
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from memkit.errors import MemkitError
from memkit.plan import TrainingPlan

OPS = {"cpu_adam": "CPUAdamBuilder", "fused_adam": "FusedAdamBuilder"}
"""DeepSpeed op NAME -> its builder class (deepspeed/ops/op_builder: cpu_adam.py, fused_adam.py)."""
BUILD_MINUTES = {"cpu_adam": 1, "fused_adam": 2}
"""Rough first-build times shown to the user (issue 15: cpu_adam + fused_adam took 340 s on a CPU box)."""


def extensions_root() -> Path:
    """Where torch builds and caches extensions (torch/utils/cpp_extension.py, _get_build_directory)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
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


def build_op(name: str) -> float:
    """Compile (or load) one op now; returns the seconds it took."""
    from deepspeed.accelerator import get_accelerator

    start = time.perf_counter()
    get_accelerator().create_op_builder(OPS[name]).load(verbose=False)
    return time.perf_counter() - start


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


def announce_builds(plan: TrainingPlan, ds_config: dict | None, *, say: bool = True) -> None:
    """Before the engine loads its ops: MemkitError on a stale build lock (instead of waiting on it
    forever); a line before a compile or while another process compiles."""
    for name in ops_for(plan, ds_config):
        state = op_state(name)
        if state.ready and state.lock is None:
            continue
        if state.lock is not None and state.lock.stale:
            raise MemkitError(state.lock.explain())
        if not say:
            continue
        if state.lock is not None:
            print(f"memkit: waiting: {state.lock.explain()}", file=sys.stderr, flush=True)
        elif not state.ready and state.compatible:
            print(f"memkit: building DeepSpeed {name} (first use, ~{BUILD_MINUTES[name]} min), cached in "
                  f"{state.build_dir}; `memkit doctor --build` prebuilds it", file=sys.stderr, flush=True)
