"""Atomic checkpoints that resume exactly, and the final Hugging Face model folder.

A checkpoint is written into `checkpoints/.tmp-step-N/` by every rank (Accelerate's save_state:
the DeepSpeed engine checkpoint with model, optimizer partitions, loss scaler and engine
counters, plus every process's RNG states), then rank 0 writes `trainer_state.json` (step,
data position, fingerprint) last, fsyncs, and publishes it with one rename to `step-N/` and
an atomic replace of the `latest` pointer. A crash at any moment leaves either the old
checkpoint or the new one complete, never a half-written one under a published name
(rename(2) is atomic within a file system; POSIX.1-2017, rename). Requires the output
directory on a file system all ranks share (as DeepSpeed's own checkpoints do).

Last of all, before the rename, `manifest.json` lists every file of the checkpoint with its size
and SHA-256 (the ranks hash the files between them). Resuming verifies it, the RNG state files
included (Accelerate's load_state skips an unreadable random_states_N.pkl with a log message at
INFO level, accelerate/checkpointing.py load_accelerator_state): a damaged checkpoint is named in
one line and the newest intact one is used instead, which is also said in one line.

What --resume trusts: data, never code. The manifest is an integrity check, not authentication
(anyone who can write the folder can re-hash it), and DeepSpeed (torch_checkpoint_engine.py,
TorchCheckpointEngine.load) and Accelerate (checkpointing.py, load_custom_state) unpickle with
`weights_only=False`, which runs whatever a pickle names. So before any rank hands a checkpoint
to them, every pickled file of it (.pt/.pth/.bin/.pkl, DCP's .metadata) is opened with torch's
weights-only unpickler (`torch.load(weights_only=True)`), which builds tensors, numbers, strings
and containers plus the few plain-data classes in `_data_globals`; a file that names anything
else is refused in one line naming it (exit 2). Checkpoints with or without a manifest alike.
The candidates for `--resume` are tried newest step first; each must have every rank's files
(its manifest's list, or without one the layout `_layout_files` says) and load as data.

Faults at save (disk full, read-only, no permission, quota) are caught at the writer on every
rank; the ranks agree on the first one and rank 0 says it in one line, the half-written
`.tmp-step-N/` is removed and the previous checkpoint stays as it was (CheckpointWriteError).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path, PosixPath, PurePosixPath

from memkit.errors import MemkitError

STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
LATEST = "latest"
PREFIX = "step-"
EXIT_CHECKPOINT_WRITE = 4
"""Exit code of a run whose checkpoint could not be written (README, exit codes)."""


_STEP = re.compile(rf"{PREFIX}\d+")


class UnsafeCheckpoint(MemkitError):
    """A checkpoint file needs code to load (its pickle names something beyond plain data)."""


class CheckpointWriteError(MemkitError):
    """A checkpoint could not be written (disk full, read-only, permission, quota)."""

    exit_code = EXIT_CHECKPOINT_WRITE


WRITE_FAULTS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EFBIG)
"""errno values that mean "this file system will not take the checkpoint"."""


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class CheckpointManager:
    """Save/find/load checkpoints under `root` (output_dir/checkpoints)."""

    def __init__(self, root: Path, accelerator, *, keep: int = 2) -> None:
        self.root = Path(root)
        self.accelerator = accelerator
        self.keep = keep

    def path_for(self, step: int) -> Path:
        return self.root / f"{PREFIX}{step:08d}"

    def save(self, step: int, state: dict, *, crash_before_publish: bool = False) -> Path:
        """Collective: every rank calls it at the same step. Returns the published folder.
        CheckpointWriteError (on every rank) when any rank could not write its part."""
        acc = self.accelerator
        final = self.path_for(step)
        tmp = self.root / f".tmp-{final.name}"
        main = _rank(acc) == 0
        done = self.complete()
        previous = done[-1].name if done else None
        fault = None
        if main:
            fault = _attempt(lambda: _fresh_folder(self.root, tmp), self.root)
        self._settle(fault, final, tmp, previous)
        # Every rank writes a small probe first: a read-only or full folder fails here, before any
        # rank enters DeepSpeed's save (whose barriers a rank that raised would never reach).
        self._settle(_attempt(lambda: _probe_write(tmp / f".probe-{_rank(acc)}"), tmp), final, tmp, previous)
        with _recorded_writes(acc) as recorded:
            fault = _attempt(lambda: acc.save_state(str(tmp), **_save_kwargs(acc)), tmp)
        self._settle(fault or recorded.fault, final, tmp, previous)
        if crash_before_publish:  # testing aid: die like a SIGKILL mid-write
            os._exit(9)
        if main:
            fault = _attempt(lambda: _write_atomic(tmp / STATE_FILE, json.dumps(state, indent=1, sort_keys=True)), tmp)
        self._settle(fault, final, tmp, previous)
        fault = _attempt(lambda: write_manifest(tmp, step=step, accelerator=acc,
                                                required=self.required_files(_world(acc))), tmp)
        self._settle(fault, final, tmp, previous)
        if main:
            fault = _attempt(lambda: self._publish(tmp, final), tmp)
        self._settle(fault, final, tmp, previous)
        return final

    def _publish(self, tmp: Path, final: Path) -> None:
        for dirpath, _, filenames in os.walk(tmp):
            for name in filenames:
                _fsync_path(Path(dirpath) / name)
            _fsync_path(Path(dirpath))
        if final.exists():  # the same step saved before (e.g. a resumed run re-saving)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_path(self.root)
        try:  # published: a pointer or pruning failure loses nothing (candidates go by step)
            _write_atomic(self.root / LATEST, final.name + "\n")
            self._prune()
        except OSError as exc:
            print(f"memkit: WARNING: checkpoint {final.name} is saved, but {self.root / LATEST} could not be "
                  f"updated ({_cause(exc, self.root)})", file=sys.stderr)

    def _settle(self, fault: str | None, final: Path, tmp: Path, previous: str | None) -> None:
        """Collective: every rank learns whether any rank failed; then all raise the same error
        (the first failing rank's cause) after rank 0 removed the half-written folder."""
        faults = [f for f in _gather([fault], self.accelerator) if f]
        if not faults:
            return
        if _rank(self.accelerator) == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = f"previous checkpoint {previous} kept" if previous else "no earlier checkpoint"
        raise CheckpointWriteError(f"could not write checkpoint {final.name} to {self.root}: {faults[0]} ({kept})")

    def required_files(self, world_size: int) -> list[str]:
        """Files every checkpoint this manager writes must hold (recorded in the manifest)."""
        return expected_files(world_size)

    def complete(self) -> list[Path]:
        """Published checkpoints (with their state file), oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob(f"{PREFIX}*") if _STEP.fullmatch(p.name) and (p / STATE_FILE).is_file()]
        return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))

    def latest(self) -> Path | None:
        pointer = self.root / LATEST
        if pointer.is_file():
            candidate = self.root / pointer.read_text().strip()
            if (candidate / STATE_FILE).is_file():
                return candidate
        done = self.complete()
        return done[-1] if done else None

    def load(self, path: Path) -> dict:
        """Collective: restore model, optimizer, loss scaler, RNG; return trainer_state.json."""
        from memkit.fileio import read_json_object

        state_file = Path(path) / STATE_FILE
        if not state_file.is_file():
            raise MemkitError(f"--resume {path}: not a complete memkit checkpoint (no {STATE_FILE})")
        state = read_json_object(state_file, what="checkpoint state")
        if state.get("world_size") != self.accelerator.num_processes:
            raise MemkitError(f"--resume {path} was written by {state.get('world_size')} processes; this "
                              f"run has {self.accelerator.num_processes}; ZeRO partitions need the same count")
        self.accelerator.load_state(str(path))
        warn_rng_not_restored(Path(path), self.accelerator)
        return state

    def damage(self, path: Path) -> str | None:
        """Collective: what is wrong with checkpoint `path` (one phrase naming the file), or None
        when it is whole and loads as data. Same answer on every rank; UnsafeCheckpoint when a
        file needs code to load."""
        found = self.inspect(path)
        return None if found is None else found[1]

    def inspect(self, path: Path) -> tuple[str, str] | None:
        """Collective: None for an intact checkpoint, else (kind, phrase naming the file) with kind
        "damaged" (fails its manifest, or does not load) or "incomplete" (a file of some rank is
        not there). Raises UnsafeCheckpoint on every rank when a pickle names code."""
        path = Path(path)
        found = _check_manifest(path, self.accelerator, layout=self._layout_required(path))
        if found is None:
            found = _check_loads(path, self.accelerator)
        found = [f for f in _gather([found], self.accelerator) if f]
        code = next((f for f in found if f[0] == "code"), None)
        if code is not None:
            raise UnsafeCheckpoint(f"--resume: {path / code[1]} needs code to load ({code[2]}), not only "
                                   "tensors and plain data; memkit resumes only checkpoints whose every file "
                                   "torch.load(weights_only=True) opens, so nothing was loaded. Delete that "
                                   "checkpoint if you did not write it")
        if found:
            return found[0][0], f"{found[0][1]} {found[0][2]}"
        if _rank(self.accelerator) == 0 and not (path / MANIFEST).is_file():
            print(f"memkit: checkpoint {path} has no {MANIFEST} (written by an older memkit, or removed); "
                  "every rank's files are there and load as data", file=sys.stderr)
        return None

    def _layout_required(self, path: Path) -> list[tuple[str, ...]]:
        """Without a manifest: the files every rank must have written (each entry: one of these),
        from trainer_state.json's world size and plan."""
        try:
            state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
            if not isinstance(state, dict):
                raise TypeError
        except (OSError, ValueError, TypeError):
            return [(STATE_FILE,)]
        world = state.get("world_size") if isinstance(state.get("world_size"), int) else _world(self.accelerator)
        if (path / DCP_DIR).is_dir():  # a split run's DCP checkpoint (split_checkpoint.DcpCheckpointManager)
            return [(n,) for n in dcp_required_files(world)] + [(f"{DCP_DIR}/{DCP_METADATA}",)]
        return [(n,) for n in self.required_files(world)] + _layout_files(path, state, world)

    def candidates(self) -> list[Path]:
        """Every step-N folder, newest step first (published or not: a stray one is named and
        skipped by resolve_resume)."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and _STEP.fullmatch(p.name)]
        return sorted(found, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)

    def _prune(self) -> None:
        for old in self.complete()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def warn_rng_not_restored(folder: Path, accelerator) -> None:
    """Collective, after Accelerate's load_state: Accelerate skips RNG states it cannot load with
    a message at INFO level (accelerate/checkpointing.py, load_accelerator_state: "Could not load
    random states"); here a WARNING line on rank 0 names every rank's file that was not restored
    (torch's CPU generator is not what the file holds)."""
    import torch
    from accelerate.utils import RNG_STATE_NAME
    from accelerate.utils.other import load

    name = f"{RNG_STATE_NAME}_{_rank(accelerator)}.pkl"
    try:
        saved = load(folder / name)["torch_manual_seed"]
        problem = None if torch.equal(saved, torch.get_rng_state()) else "not applied"
    except Exception as exc:  # noqa: BLE001 - whatever stopped Accelerate stops the check: say it
        problem = f"{type(exc).__name__}: {_first_line(str(exc))}"
    problems = [(n, p) for n, p in _gather([(name, problem)], accelerator) if p]
    if problems and _rank(accelerator) == 0:
        print(f"memkit: WARNING: the RNG states of {folder} were not restored ("
              + "; ".join(f"{n}: {p}" for n, p in problems)
              + "); dropout and other random draws after the resume differ from an uninterrupted run",
              file=sys.stderr)


# ---- faults at save ---------------------------------------------------------------------------

def _cause(exc: BaseException, folder: Path) -> str:
    """What stopped a write, in words: the errno's text ("no space left on device"), else what a
    probe write into `folder` meets (torch's zip writer reports ENOSPC as a RuntimeError without
    an errno: caffe2/serialize/inline_container.cc, PyTorchStreamWriter), else the error itself."""
    code = getattr(exc, "errno", None)
    if code is not None:
        return os.strerror(code).lower()
    probe = _attempt_errno(lambda: _probe_write(Path(folder) / ".probe-cause", size=1 << 20))
    if probe in WRITE_FAULTS:
        return os.strerror(probe).lower()
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def _attempt_errno(action) -> int | None:
    try:
        action()
    except OSError as exc:
        return exc.errno
    return None


def _write_errors() -> tuple[type, ...]:
    """What a failed write raises: OSError; RuntimeError from torch.save's stream writer;
    SafetensorError from safetensors' writer (Accelerate saves the model with it), which carries
    the OS error only in its text."""
    from safetensors import SafetensorError

    return OSError, RuntimeError, SafetensorError


def _attempt(action, folder: Path) -> str | None:
    """None when `action` ran; else the cause in words (a write fault on this rank; `folder` is
    probed when the error carries no errno)."""
    try:
        action()
    except _write_errors() as exc:
        return _cause(exc, folder)
    except BaseException as exc:
        # torch.distributed.checkpoint gathers every rank's write error into one CheckpointException
        # (a BaseException; torch/distributed/checkpoint/api.py), raised on every rank.
        failures = getattr(exc, "failures", None)
        if type(exc).__name__ != "CheckpointException" or not isinstance(failures, dict) or not failures:
            raise
        return _cause(next(iter(failures.values()))[0], folder)
    return None


def _fresh_folder(root: Path, tmp: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    if tmp.exists():  # left by a crash during an earlier save
        shutil.rmtree(tmp)
    tmp.mkdir()


def _probe_write(path: Path, *, size: int = 4096) -> None:
    """Write, fsync and remove `size` bytes at `path` (raises the file system's OSError)."""
    try:
        with open(path, "wb") as handle:
            handle.write(b"\0" * size)
            handle.flush()
            os.fsync(handle.fileno())
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def _save_kwargs(accelerator) -> dict:
    """DeepSpeed's save_checkpoint writes a `latest` tag file on rank 0 just before its last
    barrier (deepspeed/runtime/engine.py, save_checkpoint); a rank that fails there would leave
    the others in the barrier. memkit loads by tag (Accelerate's load_state passes
    "pytorch_model"), so the file is not written."""
    from accelerate.utils import DistributedType

    if accelerator is not None and getattr(accelerator, "distributed_type", None) == DistributedType.DEEPSPEED:
        return {"save_latest": False}
    return {}


class _Recorded:
    fault: str | None = None


@contextlib.contextmanager
def _recorded_writes(accelerator):
    """DeepSpeed's writes (checkpoint_engine.save / makedirs, the zero_to_fp32.py copy) record
    their first fault instead of raising, so every rank runs DeepSpeed's collectives to the end
    (deepspeed/runtime/engine.py: save_checkpoint, _save_checkpoint, _save_zero_checkpoint)."""
    record = _Recorded()
    patched = []

    def guard(owner, name):
        original = getattr(owner, name, None)
        if original is None:
            return

        def guarded(*args, **kwargs):
            if record.fault is not None:
                return None
            try:
                return original(*args, **kwargs)
            except _write_errors() as exc:
                target = next((a for a in args if isinstance(a, (str, os.PathLike))), ".")
                record.fault = _cause(exc, Path(target).parent)
                return None

        patched.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, guarded)

    for model in getattr(accelerator, "_models", []) or []:
        engine = getattr(model, "checkpoint_engine", None)
        if engine is None:
            continue
        guard(engine, "save")
        guard(engine, "makedirs")
        guard(model, "_copy_recovery_script")
    try:
        yield record
    finally:
        for owner, name, own in reversed(patched):
            if own is None:
                delattr(owner, name)  # the class's method is back
            else:
                setattr(owner, name, own)


def resolve_resume(resume: str | None, manager: CheckpointManager) -> Path | None:
    """Collective. 'latest': the newest checkpoint (by step) that is whole (manifest, or every
    rank's files present) and loads as data; each damaged or stray one named in one line on stderr,
    and the fallback said; None when there is none yet (a requeued job's first run). A path: that
    checkpoint, verified. UnsafeCheckpoint (exit 2) as soon as a file needs code to load."""
    if resume is None:
        return None
    main = _rank(manager.accelerator) == 0
    if resume == "latest":
        found = manager.candidates()
        skipped = []
        for path in found:
            problem = manager.inspect(path)
            if problem is None:
                if skipped and main:
                    print(f"memkit: resuming from {path.name}, the newest intact checkpoint "
                          f"({len(skipped)} damaged or incomplete one(s) skipped: {', '.join(skipped)})",
                          file=sys.stderr)
                return path
            skipped.append(path.name)
            if main:
                kind, text = problem
                what = "is damaged" if kind == "damaged" else "is incomplete (a partial or stray folder)"
                print(f"memkit: checkpoint {path} {what}: {text}; skipping it", file=sys.stderr)
        if skipped:
            raise MemkitError(f"--resume: every checkpoint under {manager.root} is damaged or incomplete "
                              f"({', '.join(skipped)}); move them away to start afresh")
        return None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise MemkitError(f"--resume {resume}: no complete checkpoint there (no {STATE_FILE}); pass a "
                          f"{PREFIX}N folder under {manager.root} or --resume latest")
    problem = manager.damage(path)
    if problem is not None:
        raise MemkitError(f"--resume {resume}: the checkpoint is damaged ({problem}); pass another "
                          f"{PREFIX}N folder, or --resume alone for the newest intact one")
    return path


# ---- the manifest -----------------------------------------------------------------------------

def write_manifest(folder: Path, *, step: int, accelerator, required: list[str] | None = None) -> None:
    """Collective: every rank hashes its share of `folder`'s files; rank 0 writes manifest.json,
    with the files a resume needs (`required`, default: Accelerate's layout, expected_files)."""
    files = _file_digests(folder, _my_share(_listing(folder), accelerator))
    files = dict(_gather(sorted(files.items()), accelerator))
    if required is None:
        required = expected_files(_world(accelerator))
    if _rank(accelerator) == 0:
        _write_atomic(folder / MANIFEST, json.dumps({"format_version": MANIFEST_VERSION, "step": step,
                                                     "world_size": _world(accelerator), "files": files,
                                                     "required": list(required)},
                                                    indent=1, sort_keys=True))


def _listing(folder: Path) -> list[str]:
    """Every file under `folder` (relative POSIX paths, sorted) except the manifest itself."""
    out = []
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(folder).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _rank(accelerator) -> int:
    return 0 if accelerator is None else accelerator.process_index


def _world(accelerator) -> int:
    return 1 if accelerator is None else accelerator.num_processes


def _my_share(names: list[str], accelerator) -> list[str]:
    """This rank's files to hash (all of them in a single process, accelerator None)."""
    return names[_rank(accelerator)::_world(accelerator)]


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _file_digests(folder: Path, names: list[str]) -> dict[str, dict]:
    return {n: {"bytes": (folder / n).stat().st_size, "sha256": _sha256(folder / n)} for n in names}


def _gather(items: list, accelerator) -> list:
    """Every rank's `items`, concatenated in rank order, on every rank (torch all_gather_object)."""
    if _world(accelerator) == 1:
        return list(items)
    from accelerate.utils import gather_object

    return list(gather_object(list(items)))


DCP_DIR = "dcp"
"""Where split_checkpoint's DCP checkpoint lives inside a step folder."""


def dcp_rng_file(rank: int) -> str:
    """A split run's per-rank RNG states file (split_checkpoint._save_rng)."""
    return f"rng/rank{rank}.pt"


def dcp_required_files(world_size: int) -> list[str]:
    """Files every split-run (DCP) checkpoint must hold: the trainer state and each rank's RNG states."""
    return [STATE_FILE] + [dcp_rng_file(i) for i in range(world_size)]


def expected_files(world_size: int) -> list[str]:
    """Files every checkpoint must hold: the trainer state and each process's RNG states
    (accelerate/checkpointing.py save_accelerator_state: f"{RNG_STATE_NAME}_{process_index}.pkl")."""
    from accelerate.utils import RNG_STATE_NAME

    return [STATE_FILE] + [f"{RNG_STATE_NAME}_{i}.pkl" for i in range(world_size)]


def _check_manifest(folder: Path, accelerator, *, layout: list[tuple[str, ...]]) \
        -> tuple[str, str, str] | None:
    """This rank's share of the verification: None if its files match the manifest, else (kind,
    file, what is wrong). Without a manifest (written before manifests, or deleted): every file of
    `layout` must be there."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        missing = next((names for names in layout if not any((folder / n).is_file() for n in names)), None)
        if missing is not None:
            return "incomplete", " or ".join(missing), "is missing"
        return None
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        return "damaged", MANIFEST, "is unreadable or not a memkit manifest"
    required = manifest.get("required")
    if not (isinstance(required, list) and all(isinstance(n, str) for n in required)):
        required = expected_files(int(manifest.get("world_size") or 0))
    missing = [n for n in required if n not in files]
    if missing:
        return "damaged", missing[0], f"is not in {MANIFEST}"
    for name in _my_share(sorted(files), accelerator):
        entry = files[name]
        path = folder / name
        if not path.is_file():
            return "damaged", name, "is missing"
        size = path.stat().st_size
        if size != entry.get("bytes"):
            return "damaged", name, f"is {size} bytes, the manifest says {entry.get('bytes')} (truncated or replaced)"
        if _sha256(path) != entry.get("sha256"):
            return "damaged", name, f"does not match its SHA-256 in {MANIFEST} (corrupted)"
    return None


def _layout_files(folder: Path, state: dict, world: int) -> list[tuple[str, ...]]:
    """Files of every rank a checkpoint of this layout holds besides trainer_state.json and the
    RNG states (each entry: one of these names must exist).

    DeepSpeed, under Accelerate's tag "pytorch_model" (accelerate/accelerator.py, save_state):
    deepspeed/runtime/engine.py, _get_ckpt_name (mp_rank_MM_model_states.pt; ZeRO-3:
    zero_pp_rank_D_mp_rank_MM_model_states.pt) and _get_zero_ckpt_name (ZeRO >= 1, one per
    data-parallel rank D: [bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt), MM the tensor-parallel
    rank. Plain Accelerate (accelerate/checkpointing.py,
    save_accelerator_state): the model as safetensors or .bin."""
    plan = state.get("plan") if isinstance(state.get("plan"), dict) else {}
    if (folder / "pytorch_model").is_dir():
        tp = int(plan.get("tp") or 1)
        zero = int(plan.get("zero_stage") or 0)
        dp = max(1, world // tp)
        out = []
        for mp in range(tp):
            if zero == 3:
                out += [(f"pytorch_model/zero_pp_rank_{d}_mp_rank_{mp:02d}_model_states.pt",) for d in range(dp)]
            else:
                out.append((f"pytorch_model/mp_rank_{mp:02d}_model_states.pt",))
            if zero >= 1:
                out += [tuple(f"pytorch_model/{pre}zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt"
                              for pre in ("", "bf16_")) for d in range(dp)]
        return out
    return [("model.safetensors", "pytorch_model.bin")]


# ---- what a resume unpickles ----------------------------------------------------------------------

UNPICKLED = (".pt", ".pth", ".bin", ".pkl")
"""Suffixes of the files a resume unpickles: DeepSpeed's model states and ZeRO partitions,
Accelerate's optimizer/scheduler .bin, RNG random_states_N.pkl and custom_checkpoint_N.pkl,
split_checkpoint's rng/rankN.pt."""
DCP_METADATA = ".metadata"
"""torch.distributed.checkpoint's metadata, read with pickle.load (torch/distributed/checkpoint/
filesystem.py, FileSystemReader.read_metadata)."""


def _data_globals() -> list:
    """Classes a memkit checkpoint's pickles name besides what torch's weights-only unpickler
    allows by default (tensors, numbers, strings, containers, OrderedDict, torch.Size, dtypes).
    Each is plain data: built with __new__ and its attributes set, no code of its own runs.
      - numpy arrays and dtypes of the RNG states: accelerate/utils/other.py, TORCH_SAFE_GLOBALS
        (what Accelerate's own load uses for random_states_N.pkl);
      - DeepSpeed's ZeRO optimizer state_dict: the loss scaler object (runtime/fp16/loss_scaler.py,
        LossScaler / DynamicLossScaler, saved as LOSS_SCALER in runtime/zero/stage_1_and_2.py and
        stage3.py state_dict), param_slice_mappings (utils/tensor_fragment.py, fragment_address),
        the stage (runtime/zero/config.py, ZeroStageEnum);
      - DCP's metadata (torch/distributed/checkpoint/metadata.py)."""
    from accelerate.utils.other import TORCH_SAFE_GLOBALS

    out = list(TORCH_SAFE_GLOBALS)
    with contextlib.suppress(ImportError):
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        out += [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
    with contextlib.suppress(ImportError):
        import inspect

        from torch.distributed.checkpoint import metadata as dcp
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        # every dataclass / enum the metadata module defines (Metadata, TensorStorageMetadata,
        # ChunkStorageMetadata, TensorProperties, MetadataIndex, _MEM_FORMAT_ENCODING, ...)
        out += [cls for _, cls in inspect.getmembers(dcp, inspect.isclass) if cls.__module__ == dcp.__name__]
        out += [_StorageInfo, PurePosixPath, PosixPath]  # StorageMeta.checkpoint_id: the folder, as a Path
    return out


class _DataOnlyUnpickler:
    """For DCP's .metadata, a plain pickle of protocol 4 (its FRAME opcode is beyond torch's
    weights-only unpickler): the standard library's unpickler whose find_class, the only way a
    pickle reaches a callable (Python docs, pickle, "Restricting Globals"), returns only what
    torch.load(weights_only=True) allows (torch/_weights_only_unpickler.py, _get_allowed_globals)
    plus `_data_globals`."""

    def __new__(cls, handle):
        import pickle

        import torch._weights_only_unpickler as wo

        allowed = dict(wo._get_allowed_globals())
        allowed.update({f"{obj.__module__}.{obj.__qualname__}": obj for obj in _data_globals()})

        class Restricted(pickle.Unpickler):
            def find_class(self, module, name):
                found = allowed.get(f"{module}.{name}")
                if found is None:
                    raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")
                return found

        return Restricted(handle)


def _unpickled(name: str) -> bool:
    return name.endswith(UNPICKLED) or Path(name).name == DCP_METADATA


def _load_problem(path: Path) -> tuple[str, str] | None:
    """None when `path` loads with the weights-only unpickler; ("code", the global it names) when
    its pickle names anything else; ("damaged", why) when it does not load at all."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(_data_globals()):
            if path.name == DCP_METADATA:
                with open(path, "rb") as handle:
                    _DataOnlyUnpickler(handle).load()
            else:
                with open(path, "rb") as handle:
                    zipped = handle.read(4) == b"PK\x03\x04"
                # mmap: the tensors' bytes are not read, only the pickle (torch/serialization.py, load)
                torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        named = re.search(r"GLOBAL (\S+)", text) or re.search(r"unrecognized function (\S+)", text)
        if named:
            return "code", f"its pickle names {named.group(1).rstrip('.,')}"
        inner = re.search(r"WeightsUnpickler error: (.*)", text)  # torch's own cause, after its advice
        return "damaged", f"does not load ({_first_line(inner.group(1) if inner else text)})"
    except Exception as exc:  # noqa: BLE001 - truncated zip, bad magic number, ...: damage, said in one line
        return "damaged", f"does not load ({type(exc).__name__}: {_first_line(str(exc))})"
    return None


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = lines[0] if lines else ""
    return line if len(line) <= 100 else line[:97] + "..."


def _check_loads(folder: Path, accelerator) -> tuple[str, str, str] | None:
    """This rank's share of the weights-only check of every pickled file under `folder`."""
    for name in _my_share([n for n in _listing(folder) if _unpickled(n)], accelerator):
        found = _load_problem(folder / name)
        if found is not None:
            return found[0], name, found[1]
    return None


# ---- the final model --------------------------------------------------------------------------

def gathered_state_dict(accelerator, model) -> dict | None:
    """Full state dict on the main process (None elsewhere); collective under ZeRO-3.

    ZeRO-3 with stage3_gather_16bit_weights_on_model_save: Accelerate's get_state_dict (the
    engine's consolidated 16-bit state dict). Without it, each parameter is gathered in turn
    with deepspeed.zero.GatheredParameters, so peak extra memory is one parameter.
    """
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED and \
            accelerator.state.deepspeed_plugin.zero_stage == 3 and \
            not model.zero_gather_16bit_weights_on_model_save():
        import deepspeed

        module = model.module
        out = {}
        for name, param in module.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                if accelerator.is_main_process:
                    out[name] = param.detach().cpu().clone()
        if accelerator.is_main_process:
            params = dict(module.named_parameters())
            for name, tensor in module.state_dict().items():
                if name not in params and name not in out:
                    out[name] = tensor.detach().cpu().clone()
            return out
        return None
    state = accelerator.get_state_dict(model)
    return state if accelerator.is_main_process else None


PEFT_PREFIX = "base_model.model."


def merge_lora_state_dict(state: dict, *, scaling: float) -> dict:
    """PEFT LoRA state dict -> plain model state dict with W + (B @ A) * scaling merged in
    (Hu et al. 2021, Sec. 4.1, Eq. 3; peft: tuners/lora/layer.py, Linear.get_delta_weight)."""
    out = {}
    for key, tensor in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        if ".base_layer." in name:
            module = key.split(".base_layer.")[0]
            leaf = name.split(".base_layer.")[1]
            name = name.replace(".base_layer.", ".")
            if leaf == "weight":
                a = [k for k in state if k.startswith(module + ".lora_A.") and k.endswith(".weight")]
                b = [k for k in state if k.startswith(module + ".lora_B.") and k.endswith(".weight")]
                if a and b:
                    delta = (state[b[0]].float() @ state[a[0]].float()) * scaling
                    tensor = (tensor.float() + delta).to(tensor.dtype)
        out[name] = tensor
    return out


def save_final_model(accelerator, model, tokenizer, folder: Path | None, *, lora_scaling: float | None,
                     adapter_dir: Path | None = None, base_model: str | None = None) -> None:
    """An HF folder (config, safetensors, tokenizer) that from_pretrained loads. Collective.

    A LoRA run also writes the adapter alone to `adapter_dir` (adapter_model.safetensors +
    adapter_config.json, what PeftModel.from_pretrained loads onto the base model). It is not put
    inside `folder`: transformers' from_pretrained treats a folder with adapter_config.json as an
    adapter and loads its base model instead (transformers: utils/peft_utils.py, find_adapter_config_file).
    `folder` None (a 4-bit base, memkit/plan/quantize.py): the adapter only; merging it into packed 4-bit
    weights would re-quantise them, so the result is the original base + this adapter.
    """
    state = gathered_state_dict(accelerator, model)
    if accelerator.is_main_process:
        target = folder if folder is not None else adapter_dir
        cause = _attempt(lambda: _write_final(accelerator.unwrap_model(model), tokenizer, state, folder,
                                              lora_scaling=lora_scaling, adapter_dir=adapter_dir,
                                              base_model=base_model), target.parent)
        if cause is not None:  # a write fault: one line and EXIT_CHECKPOINT_WRITE, never exit 0 (#25)
            print(f"memkit: could not write the final model to {target}: {cause} (the run's checkpoints "
                  "are kept; free space or fix the folder's permissions, then --resume)", file=sys.stderr, flush=True)
            os._exit(EXIT_CHECKPOINT_WRITE)  # peers wait in the barrier below; the launcher ends them
    accelerator.wait_for_everyone()


def _write_final(unwrapped, tokenizer, state: dict, folder: Path | None, *, lora_scaling: float | None,
                 adapter_dir: Path | None, base_model: str | None) -> None:
    """Rank 0's part of save_final_model: the adapter, then the merged HF folder."""
    if lora_scaling is not None:  # a PeftModel: save the merged weights under the base model
        if adapter_dir is not None:
            save_adapter(unwrapped, state, adapter_dir, base_model=base_model)
        if folder is None:
            return
        state = merge_lora_state_dict(state, scaling=lora_scaling)
        unwrapped = unwrapped.get_base_model()
    folder.mkdir(parents=True, exist_ok=True)
    unwrapped.save_pretrained(str(folder), state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(str(folder))


def save_adapter(peft_model, state: dict, folder: Path, *, base_model: str | None) -> None:
    """The LoRA weights alone from the gathered full state dict (peft: PeftModel.save_pretrained,
    which keeps the adapter keys via get_peft_model_state_dict)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = peft_model.peft_config["default"]
    saved_base = config.base_model_name_or_path
    if base_model is not None:
        config.base_model_name_or_path = base_model
    try:
        peft_model.save_pretrained(str(folder), state_dict=state, safe_serialization=True)
    finally:
        config.base_model_name_or_path = saved_base
