"""The software stack a run uses (torch, transformers, deepspeed, peft versions), and the memory
behaviours memkit prices differently per version.

`installed()` reads the versions of this machine (importlib.metadata); `parse_stack("transformers=4.40,
deepspeed=0.14")` is what `--stack` takes, to plan for another machine (unnamed packages keep the
installed version). Behaviours, each with the version where it changed:

- causal-LM loss (transformers): from v4.46 the models call `self.loss_function` =
  ForCausalLMLoss (transformers/loss/loss_utils.py): `logits.float()` inside the loss and the
  *labels* shifted (`nn.functional.pad(labels, (0, 1))`), no copy of the logits. Before it, each
  *ForCausalLM.forward shifted the logits: `shift_logits = logits[..., :-1, :].contiguous()`
  (e.g. transformers v4.40 models/llama/modeling_llama.py), one more logits-sized tensor alive at
  the loss's forward peak, in the dtype the loss runs in (fp32 after the upcast).
- CUDA module loading (torch): from 1.13 torch sets CUDA_MODULE_LOADING=LAZY unless the user set
  it (aten/src/ATen/cuda/detail/CUDAHooks.cpp, CUDAHooks::init), so the context holds only
  the kernels used. Older
  stacks load every kernel image at context creation: the HF "Model training anatomy" doc
  measured 1343 MiB of context on a V100 with torch of that time (transformers ~4.16), against
  memkit's 420 MiB lazy figure for that GPU -- 923 MiB of eagerly loaded kernels.
- foreach optimizers (torch): from 2.0 torch.optim picks the foreach implementation on CUDA when
  `foreach` is unset (torch/optim/optimizer.py, _default_to_fused_or_foreach), whose
  `_foreach_sqrt` makes a temporary as large as all parameters; 1.x AdamW set `foreach = False`
  when unset (torch/optim/adamw.py) and loops over parameters, one parameter's temporary at a time.
- zero_grad (torch, transformers): before torch 2.0 `Optimizer.zero_grad()` and
  `nn.Module.zero_grad()` defaulted to `set_to_none=False` (pytorch/pytorch#92731 flipped it for
  2.0), so gradients stay allocated as zeros between steps and are live through the next forward
  and backward. The HF Trainer passes `set_to_none=True` for every torch from transformers 4.27
  (huggingface/transformers#22136); before that it called `model.zero_grad()`.
- NCCL NVLS buffers (torch's NCCL): the torch 2.1-2.6 wheels pin nvidia-nccl-cu12 2.18.1-2.21.5
  (pytorch/pytorch .github/scripts/generate_binary_build_matrix.py; e.g. torch 2.2.0 requires
  nvidia-nccl-cu12==2.19.3), NCCL versions that map NVLS multicast buffers when a communicator is
  created on an NVSwitch node (estimate/cuda_extras.py). torch 2.0 ships NCCL 2.14 (no NVLS);
  torch >= 2.7 ships NCCL >= 2.26, which maps them only at the first collective that picks NVLS.
- HF gradient checkpointing (transformers): `gradient_checkpointing_enable()` without kwargs
  checkpoints with torch's reentrant variant -- torch's default until transformers pinned
  `{"use_reentrant": True}` (huggingface/transformers#28538, Jan 2024) -- until #43203 (merged
  2026-01-09, first in the 5.x line memkit takes as 5.0) made it `{"use_reentrant": False}`
  (modeling_utils.py _activation_checkpointing_enable). Reentrant checkpoint re-runs the whole
  block (torch/utils/checkpoint.py CheckpointFunction.backward): no early stop.
- ZeRO-3 debug strings (deepspeed): before v0.9.4 the ZeRO-3 parameter coordinator formatted a
  debug line per parameter at each fetch, wait, prefetch and release even with logging off
  (deepspeedai/DeepSpeed#3622, runtime/zero/partitioned_param_coordinator.py); a step-time cost
  (estimate/throughput.py ZERO3_DEBUG_CALLS_PER_PARAM).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from memkit.errors import MemkitError
from memkit.units import MIB

PACKAGES = ("torch", "transformers", "deepspeed", "peft")
FOR_CAUSAL_LM_LOSS = (4, 46)
LAZY_LOADING_TORCH = (1, 13)
FOREACH_DEFAULT_TORCH = (2, 0)
SET_TO_NONE_DEFAULT_TORCH = (2, 0)
TRAINER_SET_TO_NONE = (4, 27)
EAGER_NVLS_TORCH = ((2, 1), (2, 7))
"""torch versions [from, to) whose NCCL maps NVLS buffers at communicator creation (see above)."""
CHECKPOINT_EARLY_STOP_TORCH = (2, 1)
"""Non-reentrant torch.utils.checkpoint stops recomputing once the last saved tensor is back
(pytorch/pytorch PR #96866, 2023-03, made early stop the default; torch/utils/checkpoint.py
set_checkpoint_early_stop); earlier versions re-run the whole checkpointed function."""
EAGER_KERNEL_IMAGES_BYTES = (1343 - 420) * MIB
HF_NON_REENTRANT_TRANSFORMERS = (5, 0)
"""transformers from which gradient_checkpointing_enable() defaults to use_reentrant=False (#43203)."""
PEFT_ADAPTERS_IN_BASE_DTYPE = ((0, 7), (0, 12))
"""peft versions that give LoRA adapters the base layer's dtype: from 0.7.0 update_layer casts them
(`self.to(weight.device, dtype=weight.dtype)`, tuners/lora/layer.py); from 0.12.0 get_peft_model's
autocast_adapter_dtype=True upcasts 16-bit adapters to fp32 (tuners_utils.py _cast_adapter_dtype);
up to 0.6.x they are created in the default dtype (fp32) and only moved to the base's device
(v0.6.2 tuners/lora/layer.py update_layer, tuners/lora/model.py _replace_module)."""
ZERO3_QUIET_DEEPSPEED = (0, 9, 4)
"""DeepSpeed from which ZeRO-3 builds its debug strings only when DEBUG logging is on (#3622)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Stack:
    torch: str | None = None
    transformers: str | None = None
    deepspeed: str | None = None
    peft: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        return {name: getattr(self, name) for name in PACKAGES}

    def key(self) -> str:
        """`torch=2.13,transformers=5.24,...` (major.minor): what a local profile is keyed by."""
        return ",".join(f"{n}={_major_minor(v)}" for n, v in self.to_dict().items() if v)


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def version_tuple(version: str | None) -> tuple[int, ...] | None:
    if not version:
        return None
    out = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out) or None


def installed() -> Stack:
    """Versions installed here (None for a package that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return Stack(**found)


def parse_stack(text: str, *, base: Stack | None = None) -> Stack:
    """`transformers=4.40,deepspeed=0.14` over `base` (default: the installed stack)."""
    stack = base if base is not None else installed()
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, ver = item.partition("=")
        name = name.strip().lower()
        if not sep or name not in PACKAGES or version_tuple(ver.strip()) is None:
            raise MemkitError(f"--stack {text!r}: {item!r} is not NAME=VERSION with NAME in "
                              f"{{{','.join(PACKAGES)}}}; e.g. --stack transformers=4.40,torch=2.3")
        stack = replace(stack, **{name: ver.strip()})
    return stack


@dataclass(frozen=True, slots=True, kw_only=True)
class StackBehaviour:
    shifted_logits_copy: bool
    """The causal-LM loss makes a contiguous shifted copy of the logits (transformers < 4.46)."""
    eager_module_loading: bool
    """CUDA kernels are loaded at context creation (torch < 1.13)."""
    foreach_optimizer: bool = True
    """torch.optim defaults to the foreach implementation (torch >= 2.0)."""
    grads_kept_between_steps: bool = False
    """zero_grad() zero-fills gradients instead of freeing them (torch < 2.0, unless the Trainer of
    transformers >= 4.27 passes set_to_none=True)."""
    checkpoint_early_stop: bool = True
    """Non-reentrant checkpoint stops its recompute after the last saved tensor (torch >= 2.1)."""
    eager_nvls: bool = False
    """torch's NCCL maps NVLS buffers when a communicator is created (torch 2.1-2.6)."""
    hf_checkpoint_reentrant: bool = False
    """transformers' gradient_checkpointing_enable() defaults to reentrant checkpoint (< 5.0)."""
    zero3_debug_strings: bool = False
    """DeepSpeed ZeRO-3 formats per-parameter debug strings in every fetch/release (deepspeed < 0.9.4)."""
    lora_adapter_dtype: str | None = None
    """The dtype the stated peft gives LoRA adapters over a 16-bit base: "fp32" (peft < 0.7 or
    >= 0.12) or "base" (0.7-0.11, PEFT_ADAPTERS_IN_BASE_DTYPE); None where the stack states no peft
    (each estimate keeps its own default: the memory states price the base's dtype, the step time
    peft's current fp32, throughput.peft_fp32_adapters)."""

    @property
    def fp32_lora_adapters(self) -> bool:
        return self.lora_adapter_dtype == "fp32"
    notes: tuple[str, ...] = ()


@lru_cache(maxsize=64)
def behaviour(stack: Stack | None) -> StackBehaviour:
    """What memkit prices for `stack`; a version memkit cannot place gets one note, not a guess.
    Memoised on the stack (frozen; the answer is a pure function of its four versions, and frozen):
    every step-time and memory estimate asks for it."""
    if stack is None:
        return StackBehaviour(shifted_logits_copy=False, eager_module_loading=False)
    notes = []
    tf = version_tuple(stack.transformers)
    th = version_tuple(stack.torch)
    if stack.transformers and tf is None:
        notes.append(f"transformers {stack.transformers}: version not understood; loss priced as ForCausalLMLoss (>= 4.46)")
    if stack.torch and th is None:
        notes.append(f"torch {stack.torch}: version not understood; lazy CUDA module loading assumed")
    shifted = tf is not None and tf < FOR_CAUSAL_LM_LOSS
    if shifted:
        notes.append(f"transformers {stack.transformers} < 4.46: causal-LM loss shifts a contiguous copy of the logits")
    eager = th is not None and th < LAZY_LOADING_TORCH
    if eager:
        notes.append(f"torch {stack.torch} < 1.13: CUDA kernels load eagerly (+{EAGER_KERNEL_IMAGES_BYTES // MIB} MiB context)")
    foreach = th is None or th >= FOREACH_DEFAULT_TORCH
    if not foreach:
        notes.append(f"torch {stack.torch} < 2.0: torch.optim loops over parameters (no foreach temporaries)")
    kept = th is not None and th < SET_TO_NONE_DEFAULT_TORCH and not (tf is not None and tf >= TRAINER_SET_TO_NONE)
    if kept:
        notes.append(f"torch {stack.torch} < 2.0: zero_grad() keeps zero-filled gradients between steps")
    early_stop = th is None or th >= CHECKPOINT_EARLY_STOP_TORCH
    eager_nvls = th is not None and EAGER_NVLS_TORCH[0] <= th[:2] < EAGER_NVLS_TORCH[1]
    ds = version_tuple(stack.deepspeed)
    if stack.deepspeed and ds is None:
        notes.append(f"deepspeed {stack.deepspeed}: version not understood; ZeRO-3 hooks priced as >= 0.9.4")
    debug_strings = ds is not None and ds < ZERO3_QUIET_DEEPSPEED
    if debug_strings:
        notes.append(f"deepspeed {stack.deepspeed} < 0.9.4: ZeRO-3 formats debug strings at every parameter fetch/release")
    pf = version_tuple(stack.peft)
    if stack.peft and pf is None:
        notes.append(f"peft {stack.peft}: version not understood; LoRA adapters priced in the base's dtype")
    adapter_dtype = None if pf is None else (
        "base" if PEFT_ADAPTERS_IN_BASE_DTYPE[0] <= pf[:2] < PEFT_ADAPTERS_IN_BASE_DTYPE[1] else "fp32")
    return StackBehaviour(shifted_logits_copy=shifted, eager_module_loading=eager, foreach_optimizer=foreach,
                          grads_kept_between_steps=kept, checkpoint_early_stop=early_stop,
                          eager_nvls=eager_nvls, zero3_debug_strings=debug_strings,
                          hf_checkpoint_reentrant=tf is not None and tf < HF_NON_REENTRANT_TRANSFORMERS,
                          lora_adapter_dtype=adapter_dtype, notes=tuple(notes))
