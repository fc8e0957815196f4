"""LiveTensorTracker on tensors whose sizes are known exactly, and against torch's MemTracker."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from memkit.measure.live_tensors import LiveTensorTracker  # noqa: E402


def test_allocation_and_free_exact_bytes():
    with LiveTensorTracker() as tracker:
        a = torch.empty(1000)  # 4000 B fp32
        b = torch.zeros(10, 10, dtype=torch.bfloat16)  # 200 B
        assert tracker.live_bytes == 4200
        del a
        assert tracker.live_bytes == 200
        c = torch.ones(3, dtype=torch.float64)  # 24 B
        assert tracker.live_bytes == 224
        del b, c
    assert tracker.live_bytes == 0
    assert tracker.peak_bytes == 4200


def test_live_born_after_counts_only_later_survivors():
    with LiveTensorTracker() as tracker:
        old = torch.empty(100)  # 400 B, before the mark
        mark = tracker.now_seq
        out = torch.empty(50)  # 200 B, excluded
        tmp = torch.empty(25)  # 100 B
        view = out[:10]
        assert tracker.live_born_after(mark, exclude=[view]) == 100
        del tmp
        assert tracker.live_born_after(mark, exclude=[out]) == 0
        assert tracker.live_born_after(mark) == 200
        del old, out, view


def test_views_and_inplace_share_one_storage():
    with LiveTensorTracker() as tracker:
        a = torch.zeros(256)  # 1024 B
        views = [a[10:20], a.view(16, 16), a.t() if a.dim() == 2 else a.unsqueeze(0), a.narrow(0, 0, 8)]
        a.add_(1).mul_(2)
        a.copy_(torch.ones(256))  # the ones() temporary is 1024 B, freed at once
        assert tracker.live_bytes == 1024
        assert tracker.peak_bytes == 2048
        del a
        assert tracker.live_bytes == 1024  # the views keep the storage alive
        del views
        assert tracker.live_bytes == 0


def test_out_of_place_result_is_new_storage():
    with LiveTensorTracker() as tracker:
        a = torch.ones(100)
        b = a * 2
        assert tracker.live_bytes == 800
        c = b.to(torch.bfloat16)  # 200 B
        d = c.to(torch.bfloat16)  # same dtype: no copy
        assert tracker.live_bytes == 1000
        del a, b, c, d


def test_resize_of_tensor_and_storage():
    with LiveTensorTracker() as tracker:
        t = torch.empty(0)
        assert tracker.live_bytes == 0
        t.resize_(100)  # aten.resize_ goes through dispatch
        assert tracker.live_bytes == 400
        t.untyped_storage().resize_(1000)  # UntypedStorage.resize_ does not: patched
        assert tracker.live_bytes == 1000
        t.untyped_storage().resize_(0)  # ZeRO-3 style free
        assert tracker.live_bytes == 0
        assert tracker.peak_bytes == 1000
        del t


def test_autograd_grads_and_phases():
    with LiveTensorTracker() as tracker:
        with tracker.phase("init"):
            w = torch.zeros(64, 32, requires_grad=True)  # 8192 B
            x = torch.ones(8, 64)  # 2048 B
        with tracker.phase("forward"):
            y = x @ w  # 8x32 = 1024 B, saved nothing extra (x, w are saved by reference)
            loss = y.sum()  # 4 B
        with tracker.phase("backward"):
            loss.backward()
        del y, loss
        assert w.grad is not None
        tracker.tag([w], "param")
        tracker.tag([w.grad], "grad")
        assert tracker.live_by_tag() == {"param": 8192, "other": 2048, "grad": 8192}
    init, = tracker.records("init")
    forward, = tracker.records("forward")
    assert (init.start_live_bytes, init.end_live_bytes, init.peak_bytes) == (0, 10240, 10240)
    assert forward.end_live_bytes == 10240 + 1024 + 4
    backward, = tracker.records("backward")
    # d loss = ones_like(loss) (4 B); SumBackward expands it to 8x32 as a view (0 B); MmBackward
    # makes x.T @ dy (8192 B), which AccumulateGrad steals as w.grad; the 4 B seed is then freed.
    assert backward.peak_bytes == forward.end_live_bytes + 4 + 8192
    assert backward.end_live_bytes == forward.end_live_bytes + 8192
    assert tracker.live_at(backward.peak_seq)["grad"] == 8192


def test_adopt_counts_preexisting_tensors_once():
    before = torch.zeros(50)  # 200 B, made before the tracker
    with LiveTensorTracker() as tracker:
        assert tracker.live_bytes == 0
        assert tracker.adopt([before, before[:10]]) == 200
        assert tracker.live_bytes == 200
        del before
        assert tracker.live_bytes == 0


def test_peak_breakdown_reports_what_was_live_at_peak():
    with LiveTensorTracker() as tracker:
        p = torch.zeros(100)
        tracker.tag([p], "param")
        tmp = torch.zeros(300)
        del tmp
        q = torch.zeros(50)
    assert tracker.peak_bytes == 1600
    assert tracker.peak_breakdown() == {"param": 400, "other": 1200}
    del p, q


@pytest.mark.parametrize("reentrant", [False, True])
def test_matches_torch_memtracker_on_same_run(reentrant):
    """Both trackers watch the same run (nested modes): identical live bytes after every op."""
    from torch.distributed._tools.mem_tracker import MemTracker

    mt, lt = MemTracker(), LiveTensorTracker()
    with mt, lt:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                                          torch.nn.Linear(64, 32)) for _ in range(3)])
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        x = torch.randn(16, 32, requires_grad=True)
        for _ in range(2):
            h = x
            for block in model:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=reentrant)
            h.pow(2).mean().backward()
            del h
            opt.step()
            opt.zero_grad()
            mt.reset_mod_stats()
    mt_peak = sum(v["Total"] for v in mt.get_tracker_snapshot("peak").values())
    assert lt.peak_bytes == mt_peak
    assert lt.peak_bytes > 0
