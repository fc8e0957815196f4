"""The throughput search's shortcuts (memkit/planner/search.py) give the answer of the plain visit
they replace, with fewer estimates:

  - structures are visited in ascending (bound, index) order even though activation-offload and
    ZeRO-1/2 no-overlap structures are priced only when the visit may reach them (_bound_order,
    _dominators);
  - partial checkpointing (_partial_checkpointing) returns what the plain visit returns -
    micro-batches in order of their no-recompute step time, a full bisection over K at each,
    strict improvement, stop at the first micro-batch not faster without recompute - whichever
    micro-batch it bisects first, including where memory is not monotone in K, and after the lean
    dominator's step times are priced (_lean_keys skips the K's they show cannot beat; a test with
    those times made unsound shows the comparison would catch a wrong skip);
  - a dominated structure's bound is the minimum over every micro-batch though only some of its
    own step times are priced (_fastest).
"""
from __future__ import annotations

import pytest

from memkit.estimate.memory import estimate_memory
from memkit.planner import Request
from memkit.planner.search import (_bound, _bound_order, _dominators, _Evaluator, _largest_fitting,
                                   _partial_checkpointing, _tries_partial)
from memkit.planner.space import layouts, micro_batch_options, structures, tiers, with_micro
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec

REQUESTS = {
    # memory is not monotone in K here: ZeRO-1 opt->cpu chunked loss (no overlap) at micro 1
    # fits with K = 15..20 and 27..28 checkpointed blocks, not with 21..26
    "3b-4090": dict(model="llama-3.2-3b", gpu="rtx-4090", per_node=1, batch=64, seq=4096),
    "1b-a100": dict(model="llama-3.2-1b", gpu="a100-40gb", per_node=2, batch=64, seq=8192),
    # a 10^9-sequence batch: 43 micro-batch options per structure (planner/space.py divisors_up_to),
    # a dozen of them fit with full checkpointing
    "1b-a100-1e9": dict(model="llama-3.2-1b", gpu="a100-40gb", per_node=8, batch=10**9, seq=4096),
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


def _lean_pairs(req: Request):
    """(lean case, dominated case) pairs of _partial_cases: a no-overlap or activation-offload
    structure and its lean dominator (search._lean_keys reads the latter's step times)."""
    cases = _partial_cases(req)
    by_structure = {case[0]: case for case in cases}
    return [(by_structure[_dominators(case[0])[-1]], case) for case in cases
            if _dominators(case[0]) and _dominators(case[0])[-1] in by_structure]


def _priced_partial_plans(ev: _Evaluator) -> set:
    return {p for p in ev.memo.speeds if p.checkpointing.isdigit()}


def test_partial_checkpointing_with_lean_keys_priced_answers_as_the_plain_visit():
    """After the lean dominator's visit has priced its step times (as in the search, which visits it
    first), _partial_checkpointing skips pricing the K's that cannot beat (search._lean_keys), and its
    answer is still the plain visit's; fewer of the structure's own step times are priced."""
    req = _request("1b-a100")
    pairs = _lean_pairs(req)
    assert len(pairs) >= 4
    skipped = 0
    for lean_case, case in pairs:
        shared, alone = _Evaluator(req, estimate_memory), _Evaluator(req, estimate_memory)
        _partial_checkpointing(shared, *lean_case)
        before = _priced_partial_plans(shared)
        got = _partial_checkpointing(shared, *case)
        assert got == _plain_partial(_Evaluator(req, estimate_memory), *case), case[0]
        assert _partial_checkpointing(alone, *case) == got
        skipped += len(_priced_partial_plans(alone)) - len(_priced_partial_plans(shared) - before)
    assert skipped > 0


def test_an_unsound_lean_key_changes_the_answer():
    """The comparison above catches an unsound skip: with the lean dominator's step times replaced
    by ones slower than any plan (a lower bound that does not hold), some answer is not the plain
    visit's."""
    from dataclasses import replace

    req = _request("1b-a100")
    differs = 0
    for lean_case, case in _lean_pairs(req):
        ev = _Evaluator(req, estimate_memory)
        _partial_checkpointing(ev, *lean_case)
        for plan in _priced_partial_plans(ev):
            ev.memo.speeds[plan] = replace(ev.memo.speeds[plan], step_time_s=float("inf"))
        differs += _partial_checkpointing(ev, *case) != _plain_partial(_Evaluator(req, estimate_memory), *case)
    assert differs > 0


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
    exact = sorted((_plain_bound(ev, s), i) for i, s in enumerate(structs))
    lazy = _Evaluator(req, estimate_memory)
    order = _bound_order(lazy, structs)
    first = next(order)
    priced_at_first = len(lazy.memo.speeds)
    rest = [(bound, index) for bound, index, _, _ in order]
    assert [(first[0], first[1])] + rest == exact
    assert priced_at_first < len(lazy.memo.speeds)


def _plain_bound(ev: _Evaluator, s) -> float:
    """_bound written out: every micro-batch priced (the 'none' sibling's where partial
    checkpointing is tried)."""
    target = s.with_(checkpointing="none") if _tries_partial(ev, s) else s
    return min(ev.speed(with_micro(target, m)).step_time_s for m in micro_batch_options(ev.request, s.dp, s.pp))


@pytest.mark.parametrize("name", ["1b-a100", "1b-a100-1e9"])
def test_dominated_bounds_are_the_plain_minimum_with_fewer_step_times(name):
    """_fastest reads a dominated structure's own step times only up to where its lean dominator's
    (priced at every micro-batch) show no later micro-batch can be faster: the bound is still the
    minimum over every micro-batch, for each activation-offload and no-overlap structure."""
    req = _request(name)
    structs = _structures(req)
    ev, plain = _Evaluator(req, estimate_memory), _Evaluator(req, estimate_memory)
    dominated = [s for s in structs if _dominators(s)]
    assert len(dominated) >= 8
    for s in structs:  # the lean ones first, as the search prices them
        assert _bound(ev, s, micro_batch_options(req, s.dp, s.pp)) == _plain_bound(plain, s), s
    assert len(ev.memo.speeds) < len(plain.memo.speeds)


def test_dominated_structures_wait_unpriced_until_the_visit_reaches_them():
    """_bound_order: at the first structure yielded, no activation-offload or ZeRO-1/2 no-overlap
    structure has its bound priced (each waits under a sibling's), and every one is priced by the
    end (the order itself: the test above)."""
    req = _request("1b-a100")
    structs = _structures(req)
    dominated = [s for s in structs if s.offload_activations != "none" or (s.zero_stage in (1, 2) and not s.overlap_comm)]
    assert any(not s.overlap_comm for s in dominated) and any(s.offload_activations != "none" for s in dominated)
    ev = _Evaluator(req, estimate_memory)
    order = _bound_order(ev, structs)
    next(order)
    assert not any(s in ev.memo.bounds for s in dominated)
    list(order)
    assert all(s in ev.memo.bounds for s in dominated)


# ---- the peak floor's shortcuts against the search without them ---------------------------------
# A search whose estimator is estimate_memory with a keyword the floor does not price
# (functools.partial(..., device="cuda"), the default) makes every verdict from an exact estimate:
# no micro-batch or K is rejected on its peak floor (_Evaluator.fails) and no group's leanest plan is
# pruned on it (_Pruner.known_miss). Everything the search returns must be the same.

def _random_requests(seed: int, count: int):
    import random

    rng = random.Random(seed)
    models = ["llama-3.2-1b", "llama-3.2-3b", "qwen2.5-7b"]
    gpus = ["rtx-4090", "a100-40gb", "v100-16gb"]
    out = []
    for _ in range(count):
        per_node = rng.choice([1, 2, 8])
        # huge global batches included: the micro-batch bisection runs over many divisors
        batch = per_node * rng.choice([8, 64, 96, 10**4, 5**9, 2**20])
        out.append(Request(model=load_model_spec(rng.choice(models)), global_batch_size=batch,
                           seq_len=rng.choice([1024, 4096, 8192]),
                           hardware=Hardware(gpu=find_gpu(rng.choice(gpus)), num_gpus_per_node=per_node),
                           tp=1, pp=1, lora_rank=rng.choice([0, 0, 16])))
    return out


def _outcome(request, estimator):
    from memkit.planner import NoPlanFits, search

    try:
        r = search(request, estimator=estimator)
    except NoPlanFits as exc:
        return ("no fit", str(exc), [(m.label, m.reason, m.device_peak_bytes, m.needs) for m in exc.misses])
    return (r.chosen.label, r.chosen.micro_limit, r.notes, r.split_reason,
            [(c.label, c.memory.nvidia_smi_peak_bytes, c.speed.step_time_s) for c in r.alternatives],
            [(x.label, x.reason, x.device_peak_bytes, x.overshoot, x.step_time_s) for x in r.rejected])


@pytest.mark.slow  # two searches per request
@pytest.mark.parametrize("seed", [1, 2])
def test_floor_shortcuts_give_the_exact_search_answer(seed):
    import functools

    exact = functools.partial(estimate_memory, device="cuda")  # floors off (see above)
    outcomes = []
    for req in _random_requests(seed, 4):
        got = _outcome(req, None)
        assert got == _outcome(req, exact), (req.model.name, req.hardware.gpu.name, req.global_batch_size)
        outcomes.append(got[0])
    assert len(set(outcomes)) > 1  # not one trivial answer


def test_micro_batch_bisection_finds_the_scan_boundary_on_huge_batches():
    """_largest_fitting bisects over the divisors of the per-rank batch (planner/space.py
    divisors_up_to): on a 10^9-sequence batch it makes O(log n) verdicts, and its answer is the
    linear scan's (the last micro-batch before the first that does not fit), floors on or off."""
    import math

    req = Request(model=load_model_spec("llama-3.2-1b"), global_batch_size=10**9, seq_len=4096,
                  hardware=Hardware(gpu=find_gpu("rtx-4090"), num_gpus_per_node=8), tp=1, pp=1)
    ev = _Evaluator(req, estimate_memory)
    checked = 0
    for s in _structures(req)[::7]:
        micros = micro_batch_options(req, s.dp, s.pp)
        if ev.check(with_micro(s, micros[0])).reason:
            continue
        before = ev.num_calls + ev.num_floored
        lo = _largest_fitting(ev, s, micros)
        assert ev.num_calls + ev.num_floored - before <= math.ceil(math.log2(len(micros))) + 1
        assert not ev.check(with_micro(s, micros[lo])).reason
        if lo + 1 < len(micros):
            assert ev.check(with_micro(s, micros[lo + 1])).reason  # the floor's verdict is the estimate's
        scan = next((j - 1 for j in range(1, lo + 2) if j == len(micros) or ev.check(with_micro(s, micros[j])).reason),
                    lo)
        assert scan == lo, (s, micros, lo, scan)
        checked += 1
    assert checked >= 3


def test_floor_host_bytes_are_the_estimates_for_one_stage():
    """estimate/memory.py peak_floor_and_host: with pp = 1 its host RAM and NVMe bytes are the exact
    estimate's (the search trusts them to skip a replay, _search_throughput), and its floor is
    peak_floor_bytes, at most the exact nvidia-smi peak."""
    from memkit.estimate.memory import peak_floor_and_host, peak_floor_bytes

    req = _request("1b-a100")
    hw = Hardware(gpu=find_gpu("a100-40gb"), num_gpus_per_node=2, nvme_bytes_per_node=2 * 10**12)
    structs = _structures(req)
    checked = set()
    for s in structs[::5] + [s.with_(offload_optimizer="nvme", offload_params="nvme") for s in structs
                             if s.zero_stage == 3][:2]:
        est = estimate_memory(req.model, s, hw)
        floor, host, nvme = peak_floor_and_host(req.model, s, hw)
        assert (host, nvme) == (est.host_bytes_per_node, est.nvme_bytes_per_node), s
        assert floor == peak_floor_bytes(req.model, s, hw) <= est.nvidia_smi_peak_bytes
        checked.add((s.offload_optimizer, s.offload_params, s.offload_activations))
    assert len(checked) >= 3
