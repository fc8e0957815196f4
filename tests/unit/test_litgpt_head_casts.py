"""lit-gpt's chunked lm_head under autocast keeps one 16-bit copy of the frozen head weight per
chunk (memkit/calibrate/published_memory.py, litgpt_head_cast_bytes), measured here on CPU autocast, which runs
the same cast cache (aten/src/ATen/autocast_mode.cpp, cached_cast) as CUDA's."""
from __future__ import annotations

import pytest
import torch

from memkit.calibrate.published_memory import litgpt_head_cast_bytes
from memkit.measure.live_tensors import LiveTensorTracker

H, V, T = 64, 4096, 300  # 300 tokens in 128-token chunks: 3 chunks, the last one short


def _kept_after_forward(chunk: int) -> int:
    """Live bytes after a lit-gpt-style head forward (x.split(chunk) -> frozen lm_head per chunk)
    under bf16 autocast, above the model and input, with the outputs dropped."""
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False)
    head.weight.requires_grad_(False)  # LoRA: the head is frozen
    proj = torch.nn.Linear(H, H)       # trainable, so the head's input requires grad
    x0 = torch.randn(1, T, H)
    with LiveTensorTracker() as tracker:
        tracker.adopt([head.weight, proj.weight, proj.bias, x0])
        base = sum(tracker.live_by_tag().values())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = proj(x0).float()  # the fp32 stream ln_f returns under autocast
            outs = [head(x_i) for x_i in (x.split(chunk, dim=1) if chunk else [x])]
        loss = sum(o.float().sum() for o in outs)
        del outs
        kept = sum(tracker.live_by_tag().values()) - base
        loss.backward()  # the saved copies are what the backward needs
    return kept


def test_chunked_head_keeps_one_weight_copy_per_chunk():
    extra = _kept_after_forward(128) - _kept_after_forward(0)
    assert extra == litgpt_head_cast_bytes(seq_len=T, vocab_size=V, hidden_size=H, autocast_itemsize=2)
    assert extra == 2 * V * H * 2  # 3 chunks: two copies more than the unchunked head


@pytest.mark.parametrize("seq_len, chunks", [(1034, 9), (1024, 8), (128, 1), (100, 1)])
def test_chunk_count_rounds_up(seq_len, chunks):
    assert litgpt_head_cast_bytes(seq_len=seq_len, vocab_size=V, hidden_size=H,
                                  autocast_itemsize=2) == (chunks - 1) * V * H * 2
