"""Checkpoints, resume and the final model folder for tensor- and pipeline-split runs.

The folder protocol (`.tmp-step-N/`, trainer_state.json last, one rename, the `latest` pointer)
is memkit.train.checkpoint.CheckpointManager's; this module only says what each rank writes
into the folder and how it is read back.

Tensor parallel (DeepSpeed AutoTP): the model is a DeepSpeed engine, so Accelerate's
save_state / load_state run DeepSpeed's own checkpoint API (engine.save_checkpoint: one
`mp_rank_XX_model_states.pt` per TP rank with its shards, the optimizer states, the engine
counters; deepspeed/runtime/engine.py, _save_checkpoint) plus every rank's RNG states. The shards
are cut by the TP layout, so a tp checkpoint resumes on the same tp x dp layout only (the check is
CheckpointManager.load's world-size check plus the plan's degrees, see `check_resume_layout`).
The final folder gathers the shards with DeepSpeed's own consolidation for AutoTP
(engine._consolidated_16bit_state_dict -> _replace_module_consolidated_state_dict, which
gathers each replaced layer with GatherReplacedLayerParams; the function engine.save_16bit_model
saves from; for an fp32 model the tensors keep their dtype).

Pipeline parallel (torch.distributed.pipelining): every rank saves its stage's parameters and
optimizer states with torch.distributed.checkpoint (DCP) under the *original* model's FQNs
(`model.layers.7.mlp.up_proj.weight`, the name the unsplit model gives it, not the stage's local
index), so the checkpoint does not depend on the layout: DCP dedups the identical dp replicas on
save (DefaultSavePlanner, dedup_save_plans) and on load each rank reads the keys it asks for,
whatever layout wrote them (Distributed Checkpoint docs: "load-time resharding"). So a pp=2
checkpoint resumes on pp=2 with another dp, on pp=4, or on pp=1 (a plain torch-engine run; see
`load_dcp_into`). The final folder is a sharded HF checkpoint: each stage's dp-rank-0 writes its
own safetensors file, rank 0 writes config, tokenizer and model.safetensors.index.json (the format
transformers' from_pretrained reads for sharded weights: modeling_utils, SAFE_WEIGHTS_INDEX_NAME).
"""
from __future__ import annotations

import contextlib
import json
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from memkit.errors import MemkitError
from memkit.plan.parallel import SPLIT_LIMITS

if TYPE_CHECKING:   # annotations only; torch is imported where the functions run
    import torch
from memkit.train.checkpoint import DCP_DIR, STATE_FILE, CheckpointManager, dcp_required_files, dcp_rng_file

FORMAT_DCP = "dcp-fqn"
"""trainer_state.json "format" of a checkpoint written by this module's DCP path."""
OPTIM_PREFIX = "optim/"
MODEL_PREFIX = "model/"


# ---- names: stage-local -> the unsplit model's FQNs -----------------------------------------------

def stage_fqns(pipe) -> dict[str, torch.nn.Parameter]:
    """The stage's parameters under the unsplit model's names (tied weights once per stage)."""
    lm = pipe.module.lm
    prefix = lm.base_model_prefix
    start = pipe.first_layer
    pattern = re.compile(rf"^{re.escape(prefix)}\.layers\.(\d+)\.")
    out = {}
    for name, param in lm.named_parameters():
        out[pattern.sub(lambda m: f"{prefix}.layers.{int(m.group(1)) + start}.", name)] = param
    return out


def _optimizer_of(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps it


def _state_dict(params: dict, optimizer) -> dict:
    import torch

    opt = _optimizer_of(optimizer)
    out = {MODEL_PREFIX + fqn: p.detach() for fqn, p in params.items()}
    for fqn, p in params.items():
        for key, value in opt.state.get(p, {}).items():
            if not torch.is_tensor(value):
                raise MemkitError(f"optimizer state {key!r} of {type(opt).__name__} is not a tensor; "
                                  "split-run checkpoints hold tensor optimizer states (AdamW, SGD)")
            out[f"{OPTIM_PREFIX}{fqn}/{key}"] = value
    return out


# ---- DCP save / load --------------------------------------------------------------------------------

def save_dcp(folder: Path, params: dict, optimizer) -> None:
    """Collective over the world: this rank's parameters and optimizer states into folder/dcp."""
    import torch
    import torch.distributed.checkpoint as dcp

    with _one_process_quiet():
        dcp.save(_state_dict(params, optimizer), checkpoint_id=str(Path(folder) / DCP_DIR),
                 no_dist=not torch.distributed.is_initialized())
    _save_rng(folder)


def load_dcp_into(folder: Path, params: dict, optimizer, *, tied_names: tuple[str, str] | None = None) -> None:
    """Collective: fill `params` (FQN -> parameter) and the optimizer's states from folder/dcp,
    whatever pp/dp layout wrote it. tied_names (head, embedding): a tied head this checkpoint
    stores only under the embedding's name is read from there."""
    import torch
    import torch.distributed.checkpoint as dcp

    path = Path(folder) / DCP_DIR
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    opt = _optimizer_of(optimizer)
    alias = {}
    if tied_names and MODEL_PREFIX + tied_names[0] not in saved:
        alias[tied_names[0]] = tied_names[1]
    request: dict[str, torch.Tensor] = {}
    for fqn, p in params.items():
        src = alias.get(fqn, fqn)
        if MODEL_PREFIX + src not in saved:
            raise MemkitError(f"--resume {folder}: the checkpoint has no parameter {src!r}; it was "
                              "written for another model")
        request[MODEL_PREFIX + src] = p.detach()
        head = f"{OPTIM_PREFIX}{src}/"
        for key, meta in saved.items():
            if key.startswith(head):
                state = opt.state.setdefault(p, {})
                name = key[len(head):]
                if name not in state:  # a fresh optimizer: its states take the parameter's layout
                    state[name] = torch.zeros_like(p.detach(), dtype=meta.properties.dtype) \
                        if tuple(meta.size) == tuple(p.shape) else \
                        torch.zeros(meta.size, dtype=meta.properties.dtype, device="cpu")
                request[key] = state[name]
    with torch.no_grad(), _one_process_quiet():
        dcp.load(request, checkpoint_id=str(path), no_dist=not torch.distributed.is_initialized())
    _load_rng(folder)


@contextlib.contextmanager
def _one_process_quiet():
    """DCP warns that it assumes one process when no process group exists: that is the intent
    here (a pp=1 run in one process resuming a pipeline checkpoint)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled", category=UserWarning)
        yield


def _rank() -> int:
    import torch

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _world() -> int:
    import torch

    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _save_rng(folder: Path) -> None:
    import torch

    path = Path(folder) / dcp_rng_file(_rank())
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"torch": torch.get_rng_state(), "world_size": _world()}, path)


def _load_rng(folder: Path) -> None:
    """Per-rank RNG states, restored when the layout matches (dropout draws; none on another layout)."""
    import torch

    path = Path(folder) / dcp_rng_file(_rank())
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        if saved["world_size"] == _world():
            torch.set_rng_state(saved["torch"])


# ---- the checkpoint manager the loop uses -----------------------------------------------------------

class _DcpStateIO:
    """The accelerator as CheckpointManager sees it, with save_state / load_state writing and
    reading the DCP checkpoint of `params` + `optimizer` (everything else delegates)."""

    def __init__(self, accelerator, params: dict, optimizer, tied_names):
        self._acc, self._params, self._optimizer, self._tied = accelerator, params, optimizer, tied_names

    def __getattr__(self, name):
        return getattr(self._acc, name)

    def save_state(self, folder: str, **_) -> None:  # CheckpointManager passes DeepSpeed's kwargs to DeepSpeed only
        save_dcp(Path(folder), self._params, self._optimizer)

    def load_state(self, folder: str) -> None:
        load_dcp_into(Path(folder), self._params, self._optimizer, tied_names=self._tied)


class DcpCheckpointManager(CheckpointManager):
    """CheckpointManager whose folders hold a layout-independent DCP checkpoint."""

    def __init__(self, root: Path, accelerator, params: dict, optimizer, *, keep: int, tied_names=None):
        super().__init__(root, _DcpStateIO(accelerator, params, optimizer, tied_names), keep=keep)

    def required_files(self, world_size: int) -> list[str]:
        """The trainer state and each rank's RNG states (_save_rng); the DCP shards are listed
        with their sizes and hashes like every other file."""
        return dcp_required_files(world_size)

    def load(self, path: Path) -> dict:
        """Collective: like CheckpointManager.load, but any world size (DCP reshards)."""
        state = read_state(path)
        if state.get("format") != FORMAT_DCP:
            raise MemkitError(f"--resume {path}: written by a {_layout_of(state)} run with DeepSpeed/"
                              "Accelerate state, which only that layout reads; resume it with its own plan")
        self.accelerator.load_state(str(path))
        return state


def read_state(path: Path) -> dict:
    state_file = Path(path) / STATE_FILE
    if not state_file.is_file():
        raise MemkitError(f"--resume {path}: not a complete memkit checkpoint (no {STATE_FILE})")
    return json.loads(state_file.read_text())


def _layout_of(state: dict) -> str:
    plan = state.get("plan") or {}
    return f"dp {plan.get('dp', '?')} x tp {plan.get('tp', 1)} x pp {plan.get('pp', 1)}"


def tied_names(model_config, prefix: str = "model") -> tuple[str, str] | None:
    return ("lm_head.weight", f"{prefix}.embed_tokens.weight") \
        if getattr(model_config, "tie_word_embeddings", False) else None


def manager_for(plan, root: Path, accelerator, *, keep: int, resume_path: Path | None, pipe=None,
                model=None, optimizer=None, model_config=None):
    """The checkpoint manager of this run: DCP for a pipeline, and for a plain torch-engine run
    resuming a DCP checkpoint (pp -> pp=1 resharding); CheckpointManager otherwise (data parallel,
    and tp, whose DeepSpeed engine checkpoints itself)."""
    tied = tied_names(model_config) if model_config is not None else None
    if pipe is not None:
        return DcpCheckpointManager(root, accelerator, stage_fqns(pipe), optimizer, keep=keep, tied_names=tied)
    if resume_path is not None and read_state(resume_path).get("format") == FORMAT_DCP:
        if str(accelerator.distributed_type).endswith("DEEPSPEED"):
            raise MemkitError(f"--resume {resume_path}: a pipeline (DCP) checkpoint resumes on a plan without "
                              "DeepSpeed (pp >= 1, or tp=1 pp=1 with engine torch), not under DeepSpeed")
        unwrapped = accelerator.unwrap_model(model)
        return DcpCheckpointManager(root, accelerator, dict(unwrapped.named_parameters()), optimizer,
                                    keep=keep, tied_names=tied)
    return CheckpointManager(root, accelerator, keep=keep)


def check_resume_layout(plan, resume: str | None, output_dir: Path) -> None:
    """Before any process group: a tensor-parallel checkpoint holds DeepSpeed's per-TP-rank
    shards, so it resumes on the same dp x tp x pp only; a pipeline reads DCP checkpoints only
    (one line, exit 2 otherwise)."""
    if resume is None or plan is None:
        return
    path = CheckpointManager(Path(output_dir) / "checkpoints", None).latest() if resume == "latest" else Path(resume)
    if path is None or not (path / STATE_FILE).is_file():
        return  # nothing to resume yet, or resolve_resume's own message
    state = read_state(path)
    saved = state.get("plan") or {}
    autotp = (plan.tp > 1 and plan.pp == 1) or (saved.get("tp", 1) > 1 and saved.get("pp", 1) == 1)
    if autotp:
        if (saved.get("tp", 1), saved.get("dp", 1), saved.get("pp", 1)) != (plan.tp, plan.dp, plan.pp):
            raise MemkitError(
                f"--resume {path}: written by {_layout_of(state)}, this run is dp {plan.dp} x tp {plan.tp} x "
                f"pp {plan.pp}; {SPLIT_LIMITS}; resume with the checkpoint's plan")
    if plan.pp > 1 and state.get("format") != FORMAT_DCP:
        raise MemkitError(f"--resume {path}: written by a {_layout_of(state)} run as DeepSpeed/Accelerate state, "
                          "which a pipeline cannot read (it reads pipeline and torch-engine DCP checkpoints); "
                          "resume with the checkpoint's plan")


def trainer_state_extra(manager) -> dict:
    """Fields a DCP checkpoint adds to trainer_state.json (what `manager_for` reads back)."""
    return {"format": FORMAT_DCP} if isinstance(manager, DcpCheckpointManager) else {}


# ---- the final model folder ---------------------------------------------------------------------------

def save_final_tp(engine, unwrapped_model, tokenizer, folder: Path, *, is_main: bool) -> None:
    """Collective: gather the AutoTP shards (DeepSpeed's consolidation) and write one HF folder."""
    import torch

    state = engine._consolidated_16bit_state_dict()  # all ranks take part; rank 0 gets the dict
    if is_main:
        folder.mkdir(parents=True, exist_ok=True)
        _save_config(unwrapped_model.config, unwrapped_model, folder)
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in _drop_tied(state, unwrapped_model.config).items()},
                  str(folder / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(str(folder))
    torch.distributed.barrier()


def save_final_pp(pipe, tokenizer, folder: Path, *, model_config) -> None:
    """Collective: each stage's dp-rank-0 writes its shard under the unsplit FQNs; rank 0 writes
    the index, the config and the tokenizer."""
    import torch

    from safetensors.torch import save_file

    layout = pipe.layout
    name = f"model-{layout.pp_stage + 1:05d}-of-{layout.pp:05d}.safetensors"
    # Tensor-parallel shards (DTensor) gathered over the TP group: a collective on every TP rank.
    state = {k: _full(p).cpu().contiguous() for k, p in stage_fqns(pipe).items()}
    state = _drop_tied(state, model_config)
    writer = layout.dp_rank == 0 and layout.tp_rank == 0
    if writer:
        folder.mkdir(parents=True, exist_ok=True)
        save_file(state, str(folder / name), metadata={"format": "pt"})
    entries = [None] * layout.world_size
    torch.distributed.all_gather_object(entries, {"file": name, "keys": sorted(state),
                                                  "bytes": sum(t.numel() * t.element_size() for t in state.values()),
                                                  "writer": writer})
    if layout.rank == 0:
        weight_map = {k: e["file"] for e in entries if e["writer"] for k in e["keys"]}
        total = sum(e["bytes"] for e in entries if e["writer"])
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
        _save_config(model_config, pipe.module.lm, folder)
        tokenizer.save_pretrained(str(folder))
    torch.distributed.barrier()


def _full(param):
    from torch.distributed.tensor import DTensor

    p = param.detach()
    return p.full_tensor() if isinstance(p, DTensor) else p


def _drop_tied(state: dict, config) -> dict:
    if getattr(config, "tie_word_embeddings", False):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    return state


def _save_config(config, model, folder: Path) -> None:
    """config.json with the weights' dtype (what PreTrainedModel.save_pretrained records) and
    generation_config.json."""
    import copy

    out = copy.deepcopy(config)
    out.dtype = model.dtype
    out.save_pretrained(str(folder))
    _write_generation_config(model, folder)


def _write_generation_config(model, folder: Path) -> None:
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(str(folder))


def save_probe_pp(pipe, data, path: Path) -> None:
    """Collective: the trained pipeline's logits on sequence 0 (the same probe the data-parallel
    path writes): dp replica 0 runs the stages in turn, hidden states passed point to point; the
    last stage writes the file."""
    import torch
    import torch.distributed as dist

    layout = pipe.layout
    probe = data.batch([0])
    ids = probe["input_ids"]
    if layout.dp_rank == 0:
        module = pipe.module
        module.eval()
        dtype = next(module.parameters()).dtype
        hidden = module.lm.config.hidden_size
        with torch.no_grad():
            if layout.is_first_stage:
                x = ids.to(pipe.device)
            else:
                x = torch.empty((ids.shape[0], ids.shape[1], hidden), dtype=dtype, device=pipe.device)
                dist.recv(x, src=layout.rank_of(dp_rank=0, pp_stage=layout.pp_stage - 1, tp_rank=layout.tp_rank))
            y = module(x)  # under tp every rank of the TP group runs its shard (collectives inside)
            if not layout.is_last_stage:
                dist.send(y.contiguous(), dst=layout.rank_of(dp_rank=0, pp_stage=layout.pp_stage + 1,
                                                             tp_rank=layout.tp_rank))
            elif layout.tp_rank == 0:
                torch.save({"input_ids": ids, "attention_mask": probe["attention_mask"],
                            "logits": y.float().cpu(), "dtype": str(dtype)}, path)
        module.train()
    dist.barrier()
