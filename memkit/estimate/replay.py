"""From the phase walk's moments to the allocator's alloc/free events.

memory.py describes a training step as a sequence of moments, each a breakdown of the bytes live
then by component (weights, gradients, activations, ...). Between two moments a component grows
or shrinks; here each change becomes allocations or frees of tensors of that component's own
sizes (a parameter's shape, one saved activation of a block, one micro-batch of logits), freed
last-in first-out -- PyTorch frees a block's saved tensors when its backward has run, so the last
block's go first. The requested bytes of the replay equal the moments' sums exactly (a partial
free frees the top tensor and allocates what is left of it), so the replay's requested peak is the
phase walk's allocated peak; what the allocator adds on top is rounding, unsplit remainders, and
cached segments that the next sizes cannot reuse.

Granularity: parameters, gradients and optimizer states as one tensor per block (the embedding
and head on their own), of the size the rank holds where it holds a shard (memory.py _shard_chunks); DeepSpeed's flat fp32 partitions as one tensor each
(deepspeed/runtime/zero/stage_1_and_2.py, single_partition_of_fp32_groups); a block's saved
activations by region of the block (attention, MLP, norms -- the tape's labels), not per tensor.
"""
from __future__ import annotations

from itertools import count


def moment_events(moments: list[dict[str, int]], chunks: dict[str, tuple[int, ...]],
                  streams: dict[str, int] | None = None) -> list:
    """Events (key, size, stream) / (key, None) that take the live bytes through `moments` in order.
    `chunks[c]`: the sizes of the tensors component c is made of, cycled (default: one tensor);
    `streams[c]`: the CUDA stream that allocates them (default 0, the compute stream)."""
    streams = streams or {}
    keys = count()
    live: dict[str, list[tuple[int, int]]] = {}
    total: dict[str, int] = {}
    pos: dict[str, int] = {}
    events: list = []
    for moment in moments:
        # the components that change, in a fixed order (the replay is deterministic)
        names = [n for n in dict.fromkeys([*total, *moment]) if total.get(n, 0) != moment.get(n, 0)]
        for name in names:  # frees first: a moment is the most that is live at once
            drop = total.get(name, 0) - moment.get(name, 0)
            if drop <= 0:
                continue
            stack = live[name]
            while drop > 0:
                key, size = stack.pop()
                events.append((key, None))
                if size > drop:
                    rest = size - drop
                    k = next(keys)
                    events.append((k, rest, streams.get(name, 0)))
                    stack.append((k, rest))
                    drop = 0
                else:
                    drop -= size
            total[name] = moment.get(name, 0)
        for name in names:
            grow = moment.get(name, 0) - total.get(name, 0)
            if grow <= 0:
                continue
            sizes = chunks.get(name) or (grow,)
            stack = live.setdefault(name, [])
            i = pos.get(name, 0)
            while grow > 0:
                size = min(max(1, sizes[i % len(sizes)]), grow)
                i += 1
                k = next(keys)
                events.append((k, size, streams.get(name, 0)))
                stack.append((k, size))
                grow -= size
            pos[name] = i
            total[name] = moment[name]
    return events

