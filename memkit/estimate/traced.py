"""Traced activations: what autograd really saves, for any architecture transformers can build.

The hand-written tape (activations.py) replays the families memkit models op by op. For every
other model -- and to check the tape against the installed transformers -- this module builds the
HF model itself from its config with a few blocks, under FakeTensorMode (tensors that carry shape,
dtype and storage identity but no data: torch/_subclasses/fake_tensor.py), runs one training
forward (labels given, so the loss is part of it) and records with
`torch.autograd.graph.saved_tensors_hooks` every tensor autograd packs for backward.

Accounting, the same rules the live-tensor measurement follows (memkit/measure/live_tensors.py):
- a saved tensor costs its whole storage, once, however many nodes save it or views of it
  (a view keeps its base alive);
- parameters and buffers are model states, not activations; autocast's cached low-precision
  copies of parameters are priced by the phase walk (estimate/memory.py), so both are skipped;
- each storage is charged to the region that created it: the embedding (everything before the
  first block: ids, masks, rotary tables), a block, or the head (final norm, LM head, loss).
  Per-block bytes are the mean over the traced blocks; they scale by the layer count.
Saved bytes are affine in the micro batch (every tensor is batch-sized or batch-free), so two
traces, at micro batch 1 and 2, price any micro batch exactly.

The trace runs on (fake) CPU tensors. Where CUDA kernels save something else, the CUDA rules the
tape already knows are applied to the recorded tensors (device='cuda'):
- dropout: CPU multiplies by a noise tensor of the input's dtype (aten/src/ATen/native/Dropout.cpp,
  _dropout_impl); CUDA's native_dropout saves a 1-byte bool mask;
- softmax under autocast: CUDA autocast runs softmax in fp32 (torch/csrc/autograd/autocast_mode.cpp,
  fp32 op list); CPU autocast leaves it in the input dtype;
- SDPA with attention dropout: CPU has no fused kernel with dropout and takes the math path
  (aten/src/ATen/native/transformers/attention.cpp, _fused_sdp_choice_cpp); CUDA's flash kernel
  takes dropout and saves only q, k, v, out and the logsumexp, so the cuda trace calls SDPA with
  dropout_p=0 (the same saved set; the Philox seed/offset are two scalars).
torch is imported lazily: config-only commands stay instant.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from functools import lru_cache

from memkit.errors import MemkitError
from memkit.spec.hf_config import (AUTO_CLASSES, TASK_CLASSES, auto_class_for, block_lists, build_config,  # noqa: F401
                                   label_shape, layer_count_keys, peft_task_type, remote_kwargs)


@dataclass(frozen=True, slots=True, kw_only=True)
class Trace:
    """Saved bytes of one training forward, split by region."""

    block_saved_bytes: int
    """Mean over the traced blocks of the bytes each block's tensors keep saved for backward."""
    embedding_saved_bytes: int
    """Saved tensors created before the first block (token ids, masks, rotary tables, embeddings)."""
    head_saved_bytes: int
    """Saved tensors created after the last block (final norm, LM head input, fp32 log-probs)."""
    num_blocks: int
    attention: str
    """The attention implementation the trace ran ('sdpa' or 'eager')."""
    notes: tuple[str, ...] = ()
    layers: tuple[tuple[int, int], ...] = ()
    """Models with a selective scan (estimate/ssm.py): per block of the real model, in order, its
    saved bytes and the bytes its scan's backward holds beyond them (0 for an attention block of a
    hybrid stack); () for every other model."""


def trace_plan(config: dict, *, auto_class: str, plan, micro_batch_size: int, device: str) -> Trace:
    """Saved bytes of `config`'s model trained as `plan` at `micro_batch_size` (any micro batch:
    traced at 1 and 2 and extended linearly)."""
    from memkit.estimate.activations import numerics

    num = numerics(plan)
    key = (json.dumps(config, sort_keys=True), auto_class, plan.seq_len, num.weight_itemsize, num.autocast,
           plan.attention, plan.lora_rank, tuple(plan.lora_targets) if plan.is_lora else (),
           plan.lora_dropout > 0 if plan.is_lora else False, device)
    one, two = _trace(*key, 1, target_len=plan.target_len), _trace(*key, 2, target_len=plan.target_len)
    b = micro_batch_size

    def at(a: int, c: int) -> int:
        return a + (b - 1) * (c - a)

    return Trace(block_saved_bytes=at(one.block_saved_bytes, two.block_saved_bytes),
                 embedding_saved_bytes=at(one.embedding_saved_bytes, two.embedding_saved_bytes),
                 head_saved_bytes=at(one.head_saved_bytes, two.head_saved_bytes),
                 num_blocks=one.num_blocks, attention=one.attention, notes=one.notes,
                 layers=tuple((at(a1, a2), at(c1, c2)) for (a1, c1), (a2, c2) in zip(one.layers, two.layers)))


def _traced_layers(hf_config) -> tuple[int, bool]:
    """Blocks to trace, and whether they are one period of per-layer types (sliding/full attention):
    2, or one period, or DeepSeek's dense blocks and one MoE block (see _block_weights)."""
    n = getattr(hf_config, "num_hidden_layers")
    want, periodic = 2, False
    hybrid = _hybrid_period(hf_config)
    if hybrid:
        return min(n, max(2, hybrid)), True
    types = getattr(hf_config, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(set(types)) > 1:
        distinct, seen = set(types), set()
        for i, t in enumerate(types):
            seen.add(t)
            if seen == distinct:
                want, periodic = max(want, i + 1), True
                break
    k = getattr(hf_config, "first_k_dense_replace", None)  # DeepSeek: the first k blocks are dense
    if isinstance(k, int) and k > 0:
        want, periodic = max(want, k + 1), False
    return min(n, want), periodic


def _hybrid_period(hf_config) -> int:
    """Hybrid stacks that set each block's mixer and MLP by period and offset (Jamba:
    `layers_block_type` from attn_layer_period/offset, `layers_num_experts` from
    expert_layer_period/offset; jamba/configuration_jamba.py): the shortest period of the joint
    per-layer pattern, or 0 for every other config."""
    lists = [getattr(hf_config, key, None) for key in ("layers_block_type", "layers_num_experts")]
    lists = [v for v in lists if isinstance(v, (list, tuple))]
    if not lists:
        return 0
    pattern = list(zip(*lists))
    n = len(pattern)
    return next(p for p in range(1, n + 1) if all(pattern[i] == pattern[i % p] for i in range(n)))


def _shrunk(hf_config, k: int):
    n = hf_config.num_hidden_layers
    for key in layer_count_keys(hf_config):
        setattr(hf_config, key, min(getattr(hf_config, key), k))
    types = getattr(hf_config, "layer_types", None)
    derived = isinstance(getattr(type(hf_config), "layer_types", None), property)  # Mamba, Jamba: from the count
    if isinstance(types, (list, tuple)) and len(types) == n and not derived:
        hf_config.layer_types = list(types[:k])
    return hf_config


@lru_cache(maxsize=256)
def _trace(config_json: str, auto_class: str, seq_len: int, weight_itemsize: int, autocast: int | None,
           attention: str, lora_rank: int, lora_targets: tuple, lora_dropout: bool, device: str,
           micro_batch_size: int, fake: bool = True, priced_scan: bool = True, target_len: int = 0) -> Trace:
    import torch
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

    hf_config = build_config(json.loads(config_json))
    hf_config.use_cache = False
    k, periodic = _traced_layers(hf_config)
    hf_config.memkit_real_layers = {key: getattr(hf_config, key) for key in layer_count_keys(hf_config)}
    _shrunk(hf_config, k)
    dtype = torch.bfloat16 if weight_itemsize == 2 else torch.float32
    notes = []
    attn = "eager" if attention == "eager" else "sdpa"  # flash-attn 2 saves what SDPA's flash kernel does
    try:  # built on the meta device (no init, and peft's adapter moves are no-ops there), then faked
        model, attn, note = _build(auto_class, hf_config, attn, dtype, lora_rank, lora_targets, lora_dropout)
    except RefusedVariant:
        raise
    except Exception as exc:
        raise MemkitError(f"cannot build {hf_config.model_type} for tracing ({type(exc).__name__}: "
                          f"{str(exc)[:200]})") from None
    notes += [note] if note else []
    # fake=False runs real CPU tensors: the same accounting on a real step (tests check one with the other);
    # priced_scan=False runs Mamba's sequential selective-scan loop itself (estimate/ssm.py).
    from memkit.estimate.ssm import priced_scans

    with (FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()), \
            _traceable_grouped_mm(), _unpacked_batch(), \
            (priced_scans(lambda: recorder.region) if priced_scan else contextlib.nullcontext()) as scans:
        _materialise(model)
        model.train()
        ids = torch.zeros((micro_batch_size, seq_len), dtype=torch.long)
        labels = torch.zeros(label_shape(auto_class, micro_batch_size, seq_len, target_len), dtype=torch.long)
        failed = []  # a failed attempt's recorder holds its storages, so no key is reused
        for loss_outside in (False, True):
            recorder = _Recorder(model)
            if scans:
                scans.clear()
            cast = (torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext())
            try:
                with recorder, cast, _sdpa_without_dropout(device == "cuda"), \
                        torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
                    if not loss_outside:
                        model(input_ids=ids, labels=labels)
                    else:
                        # A model loss with a data-dependent shape, which fake tensors cannot run:
                        # DebertaV2ForSequenceClassification selects `(labels >= 0).nonzero()` rows
                        # (deberta_v2/modeling_deberta_v2.py). The same cross-entropy on every row
                        # (all labels are valid here), on the fp32 logits as it computes it.
                        logits = model(input_ids=ids).logits
                        torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1))
                break
            except DynamicOutputShapeException:
                if loss_outside:
                    raise
                failed.append(recorder)
        saved = recorder.priced(device=device, autocast=bool(autocast))
    num_blocks = len(recorder.blocks)
    weights = _block_weights(recorder.blocks, _stack_counts(hf_config, model), periodic)
    block_mean = sum(w * saved.get(label, 0) for label, w in weights.items()) // max(1, sum(weights.values()))
    return Trace(block_saved_bytes=block_mean,
                 embedding_saved_bytes=saved.get("embedding", 0), head_saved_bytes=saved.get("head", 0),
                 num_blocks=num_blocks, attention=attn, notes=tuple(notes),
                 layers=_scan_layers(recorder.blocks, saved, scans or [], _stack_counts(hf_config, model),
                                     periodic))


def _scan_layers(labels: list[str], saved: dict[str, int], scans: list[tuple[str, int]],
                 real_counts: dict[str, int], periodic: bool) -> tuple[tuple[int, int], ...]:
    """(saved, scan backward) bytes of every real block of a model whose trace ran a selective scan
    (() otherwise). Traced blocks that are one period of the layer pattern (_traced_layers): real
    block i is traced block i mod period; otherwise the last traced block stands for the rest."""
    if not scans or not labels:
        return ()
    scan = {}
    for label, nbytes in scans:
        region = "block" + label[5:] if label.startswith("block") else label
        scan[region] = max(scan.get(region, 0), nbytes)
    period = len(labels)
    total = sum(real_counts.values()) or period
    pick = [labels[i % period] if periodic else labels[min(i, period - 1)] for i in range(total)]
    return tuple((saved.get(label, 0), scan.get(label, 0)) for label in pick)


def _block_weights(labels: list[str], real_counts: dict[str, int], periodic: bool) -> dict[str, int]:
    """How many of the model's blocks each traced block stands for. One period of per-layer types
    (`periodic`): the period repeats, every traced block counts alike. Otherwise the first traced
    blocks of each stack stand for themselves and its last one for the rest: the first blocks can
    differ (DeepSeek's dense `first_k_dense_replace` blocks; under LoRA nothing before the first
    adapter needs grad, so block 0 saves less)."""
    stacks: dict[str, list[str]] = {}
    for label in labels:
        stacks.setdefault(label.rsplit(".", 1)[0], []).append(label)
    weights = {}
    for stack, members in stacks.items():
        real = real_counts.get(stack, len(members))
        for label in members:
            weights[label] = 1
        if not periodic and real > len(members):
            weights[members[-1]] = real - len(members) + 1
        elif periodic:
            for label in members:
                weights[label] = real  # uniform; normalised by the sum below
    return weights


def _stack_counts(hf_config, model) -> dict[str, int]:
    """Real block count of each traced stack, keyed like the recorder's labels ('block:<list name>')."""
    counts = {}
    for name, _blocks in block_lists(model):
        key = "num_decoder_layers" if "decoder" in name and hasattr(hf_config, "num_decoder_layers") \
            else "num_hidden_layers"
        counts[f"block:{name}"] = hf_config.memkit_real_layers.get(key, getattr(hf_config, key))
    return counts


def _build(auto_class: str, hf_config, attn: str, dtype, lora_rank: int, lora_targets: tuple, lora_dropout: bool):
    """The model on the meta device, with its LoRA adapters under the task type the runner gives
    them (a classifier's head trained too: spec/hf_config.py PEFT_SAVED_HEADS); falls back to eager
    attention where the family has no SDPA path (from_config)."""
    import torch
    import transformers

    with torch.device("meta"):
        model, attn, note = from_config(getattr(transformers, auto_class), hf_config, attn, dtype)
        if lora_rank:
            from peft import LoraConfig, get_peft_model

            try:
                model = get_peft_model(model, LoraConfig(r=lora_rank, target_modules=list(lora_targets),
                                                         lora_dropout=0.05 if lora_dropout else 0.0,
                                                         task_type=peft_task_type(auto_class)))
            except ValueError as exc:  # e.g. peft refuses out_proj / conv1d for Mamba (tuners/lora/model.py)
                raise RefusedVariant(
                    f"--lora-targets {','.join(lora_targets)}: peft refuses them for {hf_config.model_type} "
                    f"({str(exc).splitlines()[0][:120]}); pass other Linear names of its blocks"
                    + (", e.g. in_proj,x_proj" if "mamba" in hf_config.model_type else "")) from None
    return model, attn, note


class RefusedVariant(MemkitError):
    """A plan the real libraries refuse for this model (one line: why, and what to pass instead);
    the estimate says so instead of pricing a stand-in block."""


def from_config(auto, hf_config, attn: str, dtype):
    """`auto.from_config` with attention `attn`, falling back to eager where the family has no SDPA
    path (transformers refuses attn_implementation='sdpa': Gemma2, Mamba, DeBERTa-v2); the model, the
    attention it runs, and a note saying so (or ''). The measured step builds with the same rule."""
    import transformers

    code = remote_kwargs(hf_config)  # --trust-remote-code: the model folder's own classes
    try:
        return auto.from_config(hf_config, attn_implementation=attn, dtype=dtype, **code), attn, ""
    except ValueError as exc:  # e.g. Gemma2 in transformers 5 has no SDPA path
        if attn != "sdpa":
            raise
        model = auto.from_config(hf_config, attn_implementation="eager", dtype=dtype, **code)
        return model, "eager", (f"{hf_config.model_type} has no SDPA path in transformers "
                                f"{transformers.__version__}: traced with eager attention "
                                f"({str(exc).splitlines()[0][:60]})")


def _materialise(model) -> None:
    """Replace every meta parameter and buffer by a CPU tensor of the same shape, dtype and grad flag
    (a fake one inside FakeTensorMode), in place: shared (tied) tensors stay shared."""
    import torch

    done: dict[int, object] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in done:
                    new = torch.zeros(t.shape, dtype=t.dtype)
                    if isinstance(t, torch.nn.Parameter):
                        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                    done[id(t)] = new
                table[name] = done[id(t)]


@contextlib.contextmanager
def _patched(module_name: str, attr: str, value):
    """Set `module.attr` for the trace, then restore it (a no-op where the attribute does not exist)."""
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ImportError:
        module = None
    original = getattr(module, attr, None)
    if original is None:
        yield
        return
    setattr(module, attr, value)
    try:
        yield
    finally:
        setattr(module, attr, original)


def _unpacked_batch():
    """transformers/masking_utils.py find_packed_sequence_indices reads position_ids to detect packed
    sequences; on a fake tensor it cannot, assumes packing and materialises the causal mask, which
    turns off SDPA's is_causal and native GQA. The batch memkit prices holds one unpadded sequence
    per row, for which the real function returns None: so does the trace."""
    return _patched("transformers.masking_utils", "find_packed_sequence_indices", lambda *a, **k: None)


def _traceable_grouped_mm():
    """MoE experts in transformers 5 run torch's grouped_mm (transformers/integrations/moe.py,
    _grouped_mm), whose fake (meta) kernel accepts bf16 only. The trace swaps in an op of the same
    shapes and dtype that saves what a matmul's autograd saves: the input if the weight needs grad,
    the weight if the input does (tools/autograd/derivatives.yaml, mm) -- so frozen (LoRA) experts
    keep no inputs."""
    import torch

    class _GroupedMM(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inp, weight, offs):
            ctx.save_for_backward(inp if weight.requires_grad else None, weight if inp.requires_grad else None)
            return inp.new_empty((inp.shape[0], weight.shape[-1]))

        @staticmethod
        def backward(ctx, grad):  # pragma: no cover -- the trace runs no backward
            raise NotImplementedError("memkit's traced grouped_mm has no backward")

    def grouped_mm(inp, weight, offs):
        return _GroupedMM.apply(inp.to(weight.dtype), weight, offs)

    return _patched("transformers.integrations.moe", "_grouped_mm", grouped_mm)


def _fused_on_cuda(args, kwargs) -> bool:
    """Whether CUDA would run this SDPA call on a fused kernel: not with a mask that needs grad (T5's
    position bias) nor with fewer K/V heads than query heads without enable_gqa (Falcon multi-query);
    those take the math path, which applies dropout itself (the fused kernels' input checks:
    aten/src/ATen/native/transformers/cuda/sdp_utils.cpp)."""
    names = ("query", "key", "value", "attn_mask")
    got = dict(zip(names, args))
    got.update({k: v for k, v in kwargs.items() if k in names})
    q, k, mask = got.get("query"), got.get("key"), got.get("attn_mask")
    if mask is not None and getattr(mask, "requires_grad", False):
        return False
    if q is not None and k is not None and q.dim() == 4 and k.shape[1] != q.shape[1] \
            and not kwargs.get("enable_gqa", False):
        return False
    return True


@contextlib.contextmanager
def _sdpa_without_dropout(active: bool):
    """CUDA pricing: SDPA's flash kernel takes dropout and saves what it saves without it (module doc)."""
    if not active:
        yield
        return
    import torch
    from torch.overrides import TorchFunctionMode

    sdpa = torch.nn.functional.scaled_dot_product_attention

    class _Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is sdpa and _fused_on_cuda(args, kwargs):  # (query, key, value, attn_mask, dropout_p, ...)
                if len(args) > 4:
                    args = (*args[:4], 0.0, *args[5:])
                else:
                    kwargs["dropout_p"] = 0.0
            return func(*args, **kwargs)

    with _Mode():
        yield


class _Recorder:
    """Region of each storage's creation, and the storages autograd saves."""

    def __init__(self, model):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        self.region = "embedding"
        self.blocks = []
        self.skip = {self._key(t) for t in list(model.parameters()) + list(model.buffers())}
        self.created: dict[int, str] = {}      # storage -> region
        self.dropout: set[int] = set()         # storages written by bernoulli_ (CPU dropout noise)
        self.softmax: set[int] = set()         # storages produced by softmax
        self.saved: dict[int, tuple[int, int]] = {}  # storage -> (nbytes, itemsize)
        self.alive = []
        self._hooks = []
        for name, blocks in block_lists(model):
            for i, block in enumerate(blocks):
                label = f"block:{name}.{i}"
                self.blocks.append(label)
                self._hooks.append(block.register_forward_pre_hook(lambda *_a, _l=label: self._enter(_l)))
                self._hooks.append(block.register_forward_hook(lambda *_a: self._enter("head")))
        recorder = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func.overloadpacket.__name__
                from_param = name == "_to_copy" and args and recorder._key(args[0]) in recorder.skip
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        key = recorder._key(t)
                        # Hold the storage: a freed one's address (its key) could be reused.
                        recorder.alive.append(t.untyped_storage())
                        if from_param:
                            recorder.skip.add(key)
                        recorder.created.setdefault(key, recorder.region)
                        if name in ("bernoulli_", "bernoulli"):
                            recorder.dropout.add(key)
                        if name in ("_softmax", "softmax"):
                            recorder.softmax.add(key)
                return out

        self.mode = _Mode()

    @staticmethod
    def _key(t) -> int:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(t.untyped_storage()).cdata

    def _enter(self, label: str) -> None:
        self.region = label

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return self.mode.__exit__(*exc)

    def pack(self, t):
        key = self._key(t)
        if key not in self.skip and key not in self.saved:
            self.saved[key] = (t.untyped_storage().nbytes(), t.element_size())
        return t

    def priced(self, *, device: str, autocast: bool) -> dict[str, int]:
        """Bytes per region, with the CUDA rules applied for device='cuda'."""
        out: dict[str, int] = {}
        for key, (nbytes, itemsize) in self.saved.items():
            region = self.created.get(key, "embedding")
            region = "block" + region[5:] if region.startswith("block") else region
            if device == "cuda" and key in self.dropout:
                nbytes //= itemsize  # native_dropout's bool mask: 1 byte per element
            elif device == "cuda" and autocast and key in self.softmax and itemsize == 2:
                nbytes *= 2  # CUDA autocast's softmax runs in fp32
            out[region] = out.get(region, 0) + nbytes
        return out
