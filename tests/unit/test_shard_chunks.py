"""The replay allocates a sharded component as one tensor per block of the size a rank holds
(memkit/estimate/memory.py _shard_chunks): FSDP / ZeRO shards, LoRA's adapters."""
from __future__ import annotations

from memkit.estimate import memory
from memkit.estimate.allocator import AllocatorConfig, replay
from memkit.estimate.replay import moment_events

MIB = 2**20


def test_a_component_held_in_shards_is_replayed_as_per_block_shards():
    block = 800 * MIB
    chunks = {"optimizer_states": (block,) * 4, "weights": (block,) * 4, "activations": (64 * MIB,)}
    # dp = 8: the rank holds an eighth of every block's states; the weights are whole
    timeline = [{"weights": 4 * block}, {"weights": 4 * block, "optimizer_states": 4 * block // 8}]
    out = memory._shard_chunks(chunks, timeline)
    assert out["optimizer_states"] == (block // 8,) * 4
    assert out["weights"] == chunks["weights"]
    assert out["activations"] == chunks["activations"]
    # the replay then allocates four 100 MiB tensors, not one 400 MiB remainder of a block tensor
    events = moment_events(timeline, out)
    sizes = [e[1] for e in events if e[1] is not None and len(e) == 3]
    assert sizes.count(block // 8) == 4


def test_shards_fit_freed_activations_and_leave_a_freed_logits_segment_cached():
    # forward: four 256 MiB activations and 1 GiB of logits; both freed; then the optimizer states
    # of four blocks of 800 MiB, a quarter held (4 x 200 MiB shards, or one block-sized 800 MiB tensor)
    act, logits = 256 * MIB, 1024 * MIB
    timeline = [{"activations": 4 * act, "logits_and_loss": logits}, {},
                {"optimizer_states": 4 * 200 * MIB}, {"optimizer_states": 4 * 200 * MIB, "logits_and_loss": logits}]
    base = {"activations": (act,), "logits_and_loss": (logits,), "optimizer_states": (800 * MIB,) * 4}
    whole = replay(moment_events(timeline, base), AllocatorConfig(caching=True))
    sharded = replay(moment_events(timeline, memory._shard_chunks(base, timeline)), AllocatorConfig(caching=True))
    # one 800 MiB tensor lands in the freed logits segment, so the next logits need a new one;
    # 200 MiB shards land in the freed activations and the logits reuse their own segment
    assert whole.reserved_peak_bytes == 4 * act + 2 * logits
    assert sharded.reserved_peak_bytes == 4 * act + logits
