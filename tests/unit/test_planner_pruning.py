"""The throughput search's shortcuts (memkit/planner/search.py) give the answer of the plain visit
they replace, with fewer estimates:

  - structures are visited in ascending (bound, index) order even though activation-offload
    structures are priced only when the visit may reach them (_bound_order);
  - partial checkpointing (_partial_checkpointing) returns what the plain visit returns -
    micro-batches in order of their no-recompute step time, a full bisection over K at each,
    strict improvement, stop at the first micro-batch not faster without recompute - whichever
    micro-batch it bisects first, including where memory is not monotone in K.
"""
from __future__ import annotations

import pytest

from memkit.estimate.memory import estimate_memory
from memkit.planner import Request
from memkit.planner.search import (_bound, _bound_order, _Evaluator, _largest_fitting, _partial_checkpointing,
                                   _tries_partial)
from memkit.planner.space import layouts, micro_batch_options, structures, tiers, with_micro
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec

REQUESTS = {
    # memory is not monotone in K here: ZeRO-1 opt->cpu chunked loss (no overlap) at micro 1
    # fits with K = 15..20 and 27..28 checkpointed blocks, not with 21..26
    "3b-4090": dict(model="llama-3.2-3b", gpu="rtx-4090", per_node=1, batch=64, seq=4096),
    "1b-a100": dict(model="llama-3.2-1b", gpu="a100-40gb", per_node=2, batch=64, seq=8192),
}


def _request(name: str) -> Request:
    r = REQUESTS[name]
    return Request(model=load_model_spec(r["model"]), global_batch_size=r["batch"], seq_len=r["seq"],
                   hardware=Hardware(gpu=find_gpu(r["gpu"]), num_gpus_per_node=r["per_node"]), tp=1, pp=1)


def _structures(req: Request):
    return structures(req, tiers(req)[0], layouts(req)[0])


def _plain_partial(ev: _Evaluator, s, micros, lo: int, full):
    """The visit _partial_checkpointing replaces, written out in full."""
    num_blocks = ev.request.model.total_layers
    best, best_j = full, micros.index(full.micro_batch_size)
    best_t = ev.speed(full).step_time_s
    for j in sorted(range(lo + 1), key=lambda i: ev.speed(with_micro(s.with_(checkpointing="none"),
                                                                          micros[i])).step_time_s):
        base = with_micro(s, micros[j])
        if ev.speed(base.with_(checkpointing="none")).step_time_s >= best_t:
            break
        k_lo, k_hi = 1, num_blocks
        while k_lo < k_hi:
            mid = (k_lo + k_hi) // 2
            if ev.check(base.with_(checkpointing=str(mid))).reason:
                k_lo = mid + 1
            else:
                k_hi = mid
        plan = base if k_hi == num_blocks else base.with_(checkpointing=str(k_hi))
        t = ev.speed(plan).step_time_s
        if t < best_t:
            best, best_j, best_t = plan, j, t
    return best, best_j


def _partial_cases(req: Request):
    """(structure, micro-batches, largest fitting index, fastest full-checkpointing plan) for every
    bf16 structure the search would hand to _partial_checkpointing."""
    ev = _Evaluator(req, estimate_memory)
    out = []
    for s in _structures(req):
        micros = micro_batch_options(req, s.dp, s.pp)
        if s.precision != "bf16" or not _tries_partial(ev, s) or ev.check(with_micro(s, micros[0])).reason:
            continue
        lo = _largest_fitting(ev, s, micros)
        full = min((with_micro(s, micros[j]) for j in range(lo + 1)),
                   key=lambda p: (ev.speed(p).step_time_s, -p.micro_batch_size))
        out.append((s, micros, lo, full))
    return out


@pytest.mark.slow  # one of the longest unit tests on 2 busy cores: the inner loop (-m 'not slow') skips it
@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_partial_checkpointing_answers_as_the_plain_visit_with_fewer_estimates(name):
    req = _request(name)
    cases = _partial_cases(req)
    assert len(cases) >= 4
    plain_calls = pruned_calls = 0
    for s, micros, lo, full in cases:
        plain, pruned = _Evaluator(req, estimate_memory), _Evaluator(req, estimate_memory)
        expected = _plain_partial(plain, s, micros, lo, full)
        assert _partial_checkpointing(pruned, s, micros, lo, full, guess=0) == expected, s
        plain_calls += plain.num_calls
        pruned_calls += pruned.num_calls
        for guess in range(1, lo + 1):  # the answer does not depend on which micro-batch goes first
            assert _partial_checkpointing(plain, s, micros, lo, full, guess=guess) == expected, (s, guess)
    assert pruned_calls < plain_calls, (pruned_calls, plain_calls)


def test_non_monotone_k_case_is_in_the_cases():
    """The 3b-4090 request holds a structure whose fits over K have a gap (what the docstring
    above says), so the test above covers a bisection that does not find the smallest fitting K."""
    req = _request("3b-4090")
    ev = _Evaluator(req, estimate_memory)
    (s,) = [s for s in _structures(req) if s.precision == "bf16" and s.zero_stage == 1 and s.offload_optimizer == "cpu"
            and s.checkpointing == "full" and s.loss == "chunked" and s.offload_activations == "none"
            and not s.overlap_comm]
    fits = [not ev.check(s.with_(checkpointing=str(k))).reason for k in range(1, req.model.total_layers)]
    first = fits.index(True)
    assert not all(fits[first:])


def test_structures_come_in_exact_bound_order_and_offload_ones_are_priced_lazily():
    req = _request("1b-a100")
    structs = _structures(req)
    assert any(s.offload_activations != "none" for s in structs)
    ev = _Evaluator(req, estimate_memory)
    exact = sorted((_bound(ev, s, micro_batch_options(req, s.dp, s.pp)), i) for i, s in enumerate(structs))
    lazy = _Evaluator(req, estimate_memory)
    order = _bound_order(lazy, structs)
    first = next(order)
    priced_at_first = len(lazy.memo.speeds)
    rest = [(bound, index) for bound, index, _, _ in order]
    assert [(first[0], first[1])] + rest == exact
    assert priced_at_first < len(lazy.memo.speeds)
