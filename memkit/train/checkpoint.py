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
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from memkit.errors import MemkitError

STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
LATEST = "latest"
PREFIX = "step-"


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
        """Collective: every rank calls it at the same step. Returns the published folder."""
        acc = self.accelerator
        final = self.path_for(step)
        tmp = self.root / f".tmp-{final.name}"
        if acc.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a crash during an earlier save
                shutil.rmtree(tmp)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        acc.wait_for_everyone()
        if crash_before_publish:  # testing aid: die like a SIGKILL mid-write
            os._exit(9)
        if acc.is_main_process:
            _write_atomic(tmp / STATE_FILE, json.dumps(state, indent=1, sort_keys=True))
        acc.wait_for_everyone()
        write_manifest(tmp, step=step, accelerator=acc, required=self.required_files(_world(acc)))
        if acc.is_main_process:
            for dirpath, _, filenames in os.walk(tmp):
                for name in filenames:
                    _fsync_path(Path(dirpath) / name)
                _fsync_path(Path(dirpath))
            if final.exists():  # the same step saved before (e.g. a resumed run re-saving)
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_path(self.root)
            _write_atomic(self.root / LATEST, final.name + "\n")
            self._prune()
        acc.wait_for_everyone()
        return final

    def required_files(self, world_size: int) -> list[str]:
        """Files every checkpoint this manager writes must hold (recorded in the manifest)."""
        return expected_files(world_size)

    def complete(self) -> list[Path]:
        """Published checkpoints (with their state file), oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob(f"{PREFIX}*") if (p / STATE_FILE).is_file()]
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
        return state

    def damage(self, path: Path) -> str | None:
        """Collective: what is wrong with checkpoint `path` (one phrase naming the file), or None
        when every file matches its manifest entry. Same answer on every rank."""
        problem = _check_manifest(Path(path), self.accelerator)
        return next((p for p in _gather([problem], self.accelerator) if p), None)

    def candidates(self) -> list[Path]:
        """Published checkpoints, the `latest` pointer's first, then newest to oldest."""
        done = list(reversed(self.complete()))
        pointer = self.root / LATEST
        if pointer.is_file():
            try:
                named = self.root / pointer.read_text().strip()
            except (OSError, UnicodeDecodeError):
                named = None
            if named in done:
                done.remove(named)
                done.insert(0, named)
        return done

    def _prune(self) -> None:
        for old in self.complete()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def resolve_resume(resume: str | None, manager: CheckpointManager) -> Path | None:
    """Collective. 'latest': the newest checkpoint whose files match its manifest (each damaged one
    named in one line on stderr, and the fallback said); None when there is none yet (a requeued
    job's first run). A path: that checkpoint, verified."""
    if resume is None:
        return None
    main = _rank(manager.accelerator) == 0
    if resume == "latest":
        found = manager.candidates()
        skipped = []
        for path in found:
            problem = manager.damage(path)
            if problem is None:
                if skipped and main:
                    print(f"memkit: resuming from {path.name}, the newest intact checkpoint "
                          f"({len(skipped)} damaged one(s) skipped: {', '.join(skipped)})", file=sys.stderr)
                return path
            skipped.append(path.name)
            if main:
                print(f"memkit: checkpoint {path} is damaged: {problem}; skipping it", file=sys.stderr)
        if skipped:
            raise MemkitError(f"--resume: every checkpoint under {manager.root} is damaged ({', '.join(skipped)}); "
                              "move them away to start afresh")
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


def expected_files(world_size: int) -> list[str]:
    """Files every checkpoint must hold: the trainer state and each process's RNG states
    (accelerate/checkpointing.py save_accelerator_state: f"{RNG_STATE_NAME}_{process_index}.pkl")."""
    from accelerate.utils import RNG_STATE_NAME

    return [STATE_FILE] + [f"{RNG_STATE_NAME}_{i}.pkl" for i in range(world_size)]


def _check_manifest(folder: Path, accelerator) -> str | None:
    """This rank's share of the verification: None if its files match the manifest."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():  # from before manifests: published atomically, not verifiable
        if _rank(accelerator) == 0:
            print(f"memkit: checkpoint {folder} has no {MANIFEST} (written by an older memkit); its files "
                  "are not verified", file=sys.stderr)
        return None
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable or not a memkit manifest"
    required = manifest.get("required")
    if not (isinstance(required, list) and all(isinstance(n, str) for n in required)):
        required = expected_files(int(manifest.get("world_size") or 0))
    missing = [n for n in required if n not in files]
    if missing:
        return f"{missing[0]} is not in {MANIFEST}"
    for name in _my_share(sorted(files), accelerator):
        entry = files[name]
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry.get("bytes"):
            return f"{name} is {size} bytes, the manifest says {entry.get('bytes')} (truncated or replaced)"
        if _sha256(path) != entry.get("sha256"):
            return f"{name} does not match its SHA-256 in {MANIFEST} (corrupted)"
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
    `folder` None (a 4-bit base, memkit/quantize.py): the adapter only; merging it into packed 4-bit
    weights would re-quantise them, so the result is the original base + this adapter.
    """
    state = gathered_state_dict(accelerator, model)
    if not accelerator.is_main_process:
        accelerator.wait_for_everyone()
        return
    unwrapped = accelerator.unwrap_model(model)
    if lora_scaling is not None:  # a PeftModel: save the merged weights under the base model
        if adapter_dir is not None:
            save_adapter(unwrapped, state, adapter_dir, base_model=base_model)
        if folder is None:
            accelerator.wait_for_everyone()
            return
        state = merge_lora_state_dict(state, scaling=lora_scaling)
        unwrapped = unwrapped.get_base_model()
    folder.mkdir(parents=True, exist_ok=True)
    unwrapped.save_pretrained(str(folder), state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    accelerator.wait_for_everyone()


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
