"""Variable-length batches through the caching allocator.

memory.py prices one steady-state step of one shape (micro_batch x seq_len). Fine-tuning data is
not one shape: with padding to the longest sample of each batch (transformers
DataCollatorWithPadding / DataCollatorForSeq2Seq, padding=True), every step has its own sequence
length, and the caching allocator keeps the segments an earlier, longer or shorter step left
behind. A segment cut for a 700-token step's activations cannot hold a 760-token step's, so a new
one is cudaMalloc'd while the old one stays cached, and reserved memory grows above what any single
shape needs. With expandable_segments the pool is one segment that grows and shrinks by pages, so
that waste mostly goes away (c10/cuda/CUDACachingAllocator.cpp, Note [Expandable Segments];
allocator.py models both).

Here the steps of a run are strung together: the first step at the first batch's length (it
creates the optimizer states, memory.py), then one steady-state step per later batch at its
length, and the whole sequence is replayed through allocator.py with or without expandable
segments. Components whose sizes do not depend on the shape (weights, gradients, optimizer states,
the cuBLAS workspace, all that init holds) stay the same tensors across steps. Every other
component (activations, logits, temporaries) is freed at the end of its step and allocated anew
at the next step's sizes. The estimate of one shape is unchanged. This module only adds the
sequence, and costs one memory.py stage per distinct length.

Padding (how a batch's length follows from its samples' lengths):
- longest: the longest sample of the batch (DataCollatorWithPadding, padding=True);
- multiple: that, rounded up to a multiple (pad_to_multiple_of);
- seq-len: every batch padded to seq_len (padding="max_length"; memkit's runner, memkit/train/data.py);
- packed: samples concatenated into full seq_len rows (every step one shape).
Samples longer than seq_len are truncated to it, as truncation=True / max_length does.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from memkit.errors import MemkitError
from memkit.estimate.allocator import replay_on_device
from memkit.estimate.replay import moment_events

PADDINGS = ("longest", "multiple", "seq-len", "packed")
MAX_STEPS = 256
"""Steps replayed at most (a seeded sample of the epoch's batches, in their order): the cache's
state depends on the sequence of shapes, and a few hundred steps show every length class many
times over while keeping a replay under a second."""
ORDERS = 5
"""Seeded epoch orders step_orders draws (seeds 0-4) for estimate_varlen to replay, its figure being
their median by reserved peak. A run is one shuffle (the Trainer's RandomSampler draws a fresh
permutation), and what the cache holds at its end depends on that order: every step longer than all
before it (a record) cudaMallocs segments for its largest tensors while the earlier, smaller ones
stay cached (CUDACachingAllocator.cpp: free blocks return to the driver only in
release_cached_blocks), and how many records come near the longest step is chance (a random
permutation of n distinct lengths has H_n = 1 + 1/2 + ... + 1/n records on average, the i-th
longest step being one with probability 1/i, so H_5 = 2.3 of them among the five longest steps).
One order's replay is one draw of that; the median of five is a steadier central figure at five
replays' cost, the distinct lengths priced once for all five (odd, so the figure is one replay's
own)."""


def parse_lengths(text: str) -> list[int]:
    """`--lengths`: a histogram 'LEN:COUNT,LEN:COUNT,...' (or bare 'LEN,LEN,...', one sample each)
    -> one entry per sample, in the order given."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        length, _, count = part.partition(":")
        try:
            n_tokens, n = int(length), int(count or 1)
        except ValueError:
            raise MemkitError(f"--lengths {text!r}: {part!r} is not LEN or LEN:COUNT; "
                              "use e.g. --lengths 128:500,512:300,2048:20") from None
        if n_tokens < 1 or n < 1:
            raise MemkitError(f"--lengths {text!r}: {part!r} needs a length and count >= 1; "
                              "use e.g. --lengths 128:500,512:300")
        out.extend([n_tokens] * n)
    if not out:
        raise MemkitError(f"--lengths {text!r} names no length; use e.g. --lengths 128:500,512:300")
    return out


def step_lengths(lengths: list[int], *, micro_batch: int, seq_len: int, padding: str = "longest",
                 multiple: int = 64, shuffle: bool = True, seed: int = 0) -> list[int]:
    """The padded sequence length of each micro-batch of an epoch over `lengths` (one per sample).
    shuffle: samples in a seeded random order (the Trainer's RandomSampler), else as given."""
    if padding not in PADDINGS:
        raise MemkitError(f"--padding {padding!r}: use one of {', '.join(PADDINGS)}")
    if padding == "multiple" and multiple < 1:
        raise MemkitError(f"--pad-multiple {multiple} must be >= 1")
    if not lengths:
        raise MemkitError("no sample lengths to batch; pass --lengths or a non-empty --data file")
    capped = [min(n, seq_len) for n in lengths]
    if padding == "packed":
        return [seq_len] * max(1, math.ceil(sum(capped) / (micro_batch * seq_len)))
    order = list(capped)
    if shuffle:
        random.Random(seed).shuffle(order)
    out = []
    for i in range(0, len(order), micro_batch):
        longest = max(order[i:i + micro_batch])
        if padding == "seq-len":
            longest = seq_len
        elif padding == "multiple":
            longest = min(seq_len, -(-longest // multiple) * multiple)
        out.append(longest)
    return out


def padding_waste(lengths: list[int], steps: list[int], *, micro_batch: int, seq_len: int) -> float:
    """Share of the tokens the steps compute on that are padding (0 when packed)."""
    real = sum(min(n, seq_len) for n in lengths)
    computed = sum(steps) * micro_batch
    return max(0.0, 1 - real / computed) if computed else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class VarlenEstimate:
    allocated_peak_bytes: int
    reserved_peak_bytes: int
    nvidia_smi_peak_bytes: int
    expandable_segments: bool
    num_steps: int
    lengths: tuple[int, ...]
    """The distinct step lengths replayed, ascending."""
    single_shape_reserved_bytes: int
    """memory.py's reserved peak for the longest step alone (one shape, the fixed-shape estimate,
    default segments)."""
    reserved_by_order: tuple[int, ...] = ()
    """The reserved peak of each order replayed (estimate_varlen's `orders`), in the order given."""


def _sample(steps: list[int], limit: int) -> list[int]:
    """At most `limit` steps, evenly spread over the epoch and in its order, the longest one always
    among them at its own place: it replaces the picked step nearest to it. The caching allocator
    keeps what earlier steps left (CUDACachingAllocator.cpp: freed blocks stay cached until
    release_cached_blocks), so each new longest step cudaMallocs new segments while the older ones
    stay; moving the epoch's longest step to the end would add one such step after all the others."""
    if len(steps) <= limit:
        return list(steps)
    stride = len(steps) / limit
    picked = [int(i * stride) for i in range(limit)]
    longest = max(range(len(steps)), key=steps.__getitem__)
    if longest not in picked:
        nearest = min(range(limit), key=lambda i: abs(picked[i] - longest))
        picked[nearest] = longest
    return [steps[i] for i in picked]


def step_orders(lengths: list[int], *, micro_batch: int, seq_len: int, padding: str = "longest",
                multiple: int = 64, orders: int | None = None) -> list[list[int]]:
    """The epoch's padded step lengths under `orders` (default ORDERS) seeded shuffles (step_lengths
    with seeds 0, 1, ...), for estimate_varlen(..., orders=...): one order where padding gives every
    step the same shape (seq-len, packed), so that the order cannot matter."""
    kw = dict(micro_batch=micro_batch, seq_len=seq_len, padding=padding, multiple=multiple)
    count = 1 if padding in ("seq-len", "packed") else (ORDERS if orders is None else orders)
    return [step_lengths(lengths, seed=seed, **kw) for seed in range(max(1, count))]


def estimate_varlen(model, plan, hardware, steps: list[int], *, expandable_segments: bool,
                    device: str = "cuda", stack=None, orders: tuple[list[int], ...] = ()) -> VarlenEstimate:
    """Reserved and nvidia-smi peaks of the steps `steps` (one sequence length each) of `plan`,
    replayed one after another through the caching allocator. `orders`: other orders of the same
    epoch (step_orders); each is replayed too and the figures are those of the median order by
    reserved peak (ORDERS says why), each order's reserved peak in `reserved_by_order`."""
    from memkit.spec.generic import task_spec

    if plan.pp > 1:
        raise MemkitError("variable-length replay prices one pipeline stage; use --pp 1 with --lengths/--data")
    # the task's head (a classifier's labels per sequence or per token) and an encoder-decoder's
    # decoder at --target-len (0: each step's length), as estimate_stages prices them (spec/generic.py)
    model = task_spec(model, plan)
    sampled = [_sample(order, MAX_STEPS) for order in (steps, *orders)]
    traces, single = _traces(model, plan, hardware, sorted({n for order in sampled for n in order}),
                             expandable_segments, device, stack)
    replays = [_replay_order(traces, order, hardware, expandable_segments, device) for order in sampled]
    ranked = sorted(range(len(replays)), key=lambda i: (replays[i][0].reserved_peak_bytes, i))
    pick = ranked[(len(ranked) - 1) // 2]  # the median (the lower middle one of an even count)
    stats, outside = replays[pick]
    order = sampled[pick]
    longest = max(order)
    allocated = max(stats.allocated_peak_bytes, single[longest].allocated_peak_bytes)
    reserved = max(stats.reserved_peak_bytes, allocated)
    return VarlenEstimate(allocated_peak_bytes=int(allocated), reserved_peak_bytes=int(reserved),
                          nvidia_smi_peak_bytes=int(reserved + outside),
                          expandable_segments=expandable_segments, num_steps=len(order),
                          lengths=tuple(sorted(set(order))),
                          single_shape_reserved_bytes=single[longest].reserved_peak_bytes,
                          reserved_by_order=tuple(max(r.reserved_peak_bytes, allocated) for r, _ in replays))


def _traces(model, plan, hardware, lengths: list[int], expandable_segments: bool, device: str, stack):
    """memory.py's replay inputs (its trace) and its one-shape estimate, per step length."""
    from memkit.estimate.memory import _stage

    traces: dict[int, dict] = {}
    single = {}
    for length in lengths:
        trace: dict = {}
        shaped = replace(plan, seq_len=length, alloc_conf="expandable" if expandable_segments else "default")
        shaped.validate()
        single[length] = _stage(model, shaped, hardware, 0, device, stack, None, trace)
        traces[length] = trace
    return traces, single


def _replay_order(traces: dict[int, dict], steps: list[int], hardware, expandable_segments: bool, device: str):
    """(the allocator's stats, the bytes outside it) for `steps` strung together: the first step's
    whole timeline up to its steady step's end, then each later step's steady step at its length."""
    from memkit.estimate.memory import SHARDED_COMPONENTS

    first = traces[steps[0]]
    shared = set(SHARDED_COMPONENTS) | set(first["timeline"][0]) | {"cublas_workspace"}

    def shaped_moment(moment: dict[str, int], length: int) -> dict[str, int]:
        return {(k if k in shared else f"{k}@{length}"): v for k, v in moment.items()}

    start, end = first["steady"]
    moments = [shaped_moment(m, steps[0]) for m in first["timeline"][:end]]
    for length in steps[1:]:
        a, b = traces[length]["steady"]
        moments += [shaped_moment(m, length) for m in traces[length]["timeline"][a:b]]
    chunks: dict[str, tuple[int, ...]] = {}
    streams: dict[str, int] = {}
    for length in set(steps):
        trace = traces[length]
        for name, sizes in trace["chunks"].items():
            chunks[name if name in shared else f"{name}@{length}"] = sizes
        for name, stream in trace["streams"].items():
            streams[name if name in shared else f"{name}@{length}"] = stream
    stats = replay_on_device(moment_events(moments, chunks, streams), caching=device == "cuda",
                             expandable_segments=expandable_segments,
                             capacity=hardware.gpu.memory_bytes - first["outside"])
    return stats, first["outside"]
