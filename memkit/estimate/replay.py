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

def moment_events(moments: list[dict[str, int]], chunks: dict[str, tuple[int, ...]],
                  streams: dict[str, int] | None = None) -> list:
    """Events (key, size, stream) / (key, None) that take the live bytes through `moments` in order.
    `chunks[c]`: the sizes of the tensors component c is made of, cycled (default: one tensor);
    `streams[c]`: the CUDA stream that allocates them (default 0, the compute stream)."""
    streams = streams or {}
    key = -1  # the last key handed out (keys count up from 0)
    live: dict[str, list[tuple[int, int]]] = {}
    total: dict[str, int] = {}
    nonzero: dict[str, int] = {}  # the components live now (total > 0), by their rank
    rank: dict[str, int] = {}  # the order each component was first seen in
    pos: dict[str, int] = {}
    events: list = []
    append = events.append
    total_get = total.get
    for moment in moments:
        # the components that change, in a fixed order (the replay is deterministic): those seen
        # before in the order first seen, then the moment's new ones in its own order. Only the
        # components live now or named by the moment can change, so the scan is over those, not
        # over every component seen so far (a variable-length replay renames each step's
        # components by its length: estimate/varlen.py).
        get = moment.get
        changed = [n for n, v in moment.items() if v != total_get(n, 0)]
        for n in changed:  # in the moment's order: a component seen for the first time gets its rank
            if n not in rank:
                rank[n] = len(rank)
        if nonzero:  # live components the moment leaves out drop to 0
            changed += [n for n in nonzero if n not in moment]
        if not changed:
            continue
        names = sorted(changed, key=rank.__getitem__)
        for name in names:  # frees first: a moment is the most that is live at once
            drop = total.get(name, 0) - get(name, 0)
            if drop <= 0:
                continue
            stack = live[name]
            while drop > 0:
                k, size = stack.pop()
                append((k, None))
                if size > drop:
                    rest = size - drop
                    key += 1
                    append((key, rest, streams.get(name, 0)))
                    stack.append((key, rest))
                    drop = 0
                else:
                    drop -= size
            total[name] = get(name, 0)
            if not total[name]:
                nonzero.pop(name, None)
        for name in names:
            grow = get(name, 0) - total.get(name, 0)
            if grow <= 0:
                continue
            sizes = chunks.get(name) or (grow,)
            n_sizes = len(sizes)
            stream = streams.get(name, 0)
            stack = live.setdefault(name, [])
            i = pos.get(name, 0)
            while grow > 0:
                size = sizes[i % n_sizes]
                size = 1 if size < 1 else size
                size = grow if grow < size else size
                i += 1
                key += 1
                append((key, size, stream))
                stack.append((key, size))
                grow -= size
            pos[name] = i
            total[name] = moment[name]
            nonzero[name] = rank[name]
    return events
