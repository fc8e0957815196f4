"""Find the best plan that fits: keep plans memkit's estimate says fit, rank by the step-time model.

Search (objective 'throughput'), branch and bound:
  1. For every structure (a plan minus its micro-batch) the step-time model - microseconds, no
     memory estimate - gives the best time any of its micro-batches could reach: an optimistic
     bound.
  2. Structures are visited best bound first. Memory grows with the micro-batch, so a binary
     search over the micro-batch sizes that divide the per-rank batch finds the largest that
     fits in O(log n) memory estimates; the fastest feasible micro-batch is kept.
  3. The visit stops once the next bound is slower than the best plans already found, so a 70B
     model on 64 GPUs costs a few hundred memory estimates, not tens of thousands.
Structures visited and found not to fit are the 'rejected' plans the CLI explains.

Objective 'memory': every structure at micro-batch 1 (its smallest peak); lowest peak wins,
near-ties (within 1% of the budget) go to the faster plan.

Tiers: AdamW with mixed precision / fp32 first; pure bf16 and 8-bit AdamW / Adafactor only when
nothing in the first tier fits (they change the training numerics), and the result says so.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

from memkit.errors import MemkitError, NoFeasiblePlan
from memkit.estimate.result import MemoryEstimate
from memkit.estimate.throughput import StepTimeEstimate, estimate_step_time
from memkit.plan import TrainingPlan
from memkit.planner.space import (Request, Tier, describe, layouts, micro_batch_options, structures,
                                  tiers, with_micro)
from memkit.units import GIB


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """A plan that fits, with its memory and speed estimates."""

    plan: TrainingPlan
    memory: MemoryEstimate
    speed: StepTimeEstimate
    tier: str
    micro_limit: str = ""
    """Why the micro-batch is not larger ('' when the per-rank batch itself is the limit)."""

    @property
    def label(self) -> str:
        return describe(self.plan)


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejection:
    """A plan that does not fit, and why."""

    plan: TrainingPlan
    reason: str
    reserved_peak_bytes: int
    host_bytes_per_node: int
    overshoot: float
    """Worst of need/limit over device memory, host RAM and NVMe (> 1 means it does not fit)."""
    step_time_s: float
    """The step time this structure could have reached if memory allowed (the search bound)."""
    needs: tuple[str, ...] = ()
    """What would make it fit (filled for the nearest misses when nothing fits)."""

    @property
    def label(self) -> str:
        return describe(self.plan)


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchResult:
    request: Request
    chosen: Candidate
    alternatives: tuple[Candidate, ...]
    rejected: tuple[Rejection, ...]
    """Structures that would have ranked above the chosen plan but do not fit, best first."""
    notes: tuple[str, ...]
    num_structures: int
    num_memory_estimates: int


class NoPlanFits(NoFeasiblePlan):
    """No plan fits: carries the nearest misses and what each would need (CLI exit code 3)."""

    def __init__(self, message: str, misses: tuple[Rejection, ...]):
        super().__init__(message)
        self.misses = misses


class _Evaluator:
    """Memoised memory estimates and the feasibility verdict for one request."""

    def __init__(self, request: Request, estimator):
        self.request = request
        self.estimator = estimator
        self.budget = request.budget_bytes
        self.num_calls = 0
        self._cache: dict[TrainingPlan, tuple[MemoryEstimate | None, str, float]] = {}

    def check(self, plan: TrainingPlan) -> tuple[MemoryEstimate | None, str, float]:
        """(estimate, reason it does not fit or '', overshoot ratio)."""
        hit = self._cache.get(plan)
        if hit is not None:
            return hit
        self.num_calls += 1
        hw = self.request.hardware
        try:
            est = self.estimator(self.request.model, plan, hw)
        except MemkitError as exc:  # the estimator refuses a combination: a rejection, not a crash
            out = (None, str(exc), float("inf"))
            self._cache[plan] = out
            return out
        ratios = [(est.reserved_peak_bytes / self.budget,
                   f"{est.reserved_peak_bytes / GIB:.1f} GiB > {self.budget / GIB:.1f} GiB budget"),
                  (est.host_bytes_per_node / hw.host_ram_bytes_per_node,
                   f"host RAM {est.host_bytes_per_node / GIB:.1f} GiB > "
                   f"{hw.host_ram_bytes_per_node / GIB:.1f} GiB per node"),
                  (est.nvme_bytes_per_node / hw.nvme_bytes_per_node if hw.nvme_bytes_per_node else 0.0,
                   f"NVMe {est.nvme_bytes_per_node / GIB:.1f} GiB > {hw.nvme_bytes_per_node / GIB:.1f} GiB per node")]
        worst, why = max(ratios, key=lambda r: r[0])
        out = (est, why if worst > 1.0 else "", worst)
        self._cache[plan] = out
        return out

    def speed(self, plan: TrainingPlan) -> StepTimeEstimate:
        return estimate_step_time(self.request.model, plan, self.request.hardware)


def search(request: Request, *, estimator=None, num_alternatives: int = 4) -> SearchResult:
    """The best plan for `request`; NoPlanFits when none fits, MemkitError for bad input."""
    if estimator is None:
        from memkit.estimate.memory import estimate_memory as estimator
    request.validate()
    lays = layouts(request)
    notes: list[str] = []
    num_gpus = request.hardware.num_gpus
    if request.global_batch_size % num_gpus and all(dp < num_gpus for _, _, dp in lays):
        notes.append(f"global batch {request.global_batch_size} is not divisible by {num_gpus} GPUs; only "
                     f"layouts with data-parallel degree {sorted({dp for _, _, dp in lays})} are possible")
    ev = _Evaluator(request, estimator)
    all_rejected: list[Rejection] = []
    num_structures = 0
    tier_list = tiers(request)
    for i, tier in enumerate(tier_list):
        structs = [s for lay in lays for s in structures(request, tier, lay)]
        num_structures += len(structs)
        if request.objective == "memory":
            found, rejected = _search_memory(ev, structs, tier)
        else:
            found, rejected = _search_throughput(ev, structs, tier, keep=2 * (num_alternatives + 1))
        all_rejected += rejected
        if found:
            if i > 0:
                notes.append(f"no {tier_list[0].name}-tier plan (AdamW, mixed precision or fp32) fits; "
                             f"chose from the {tier.name} tier (pure bf16 / 8-bit AdamW / Adafactor)")
            chosen = found[0]
            alternatives = _distinct(found[1:], chosen, num_alternatives)
            if request.objective == "throughput":
                better = [r for r in rejected if r.step_time_s < chosen.speed.step_time_s]
            else:
                better = [r for r in rejected if r.reserved_peak_bytes < chosen.memory.reserved_peak_bytes]
            return SearchResult(request=request, chosen=chosen, alternatives=tuple(alternatives),
                                rejected=tuple(better), notes=tuple(notes), num_structures=num_structures,
                                num_memory_estimates=ev.num_calls)
    raise _no_fit(request, ev, all_rejected)


def _search_throughput(ev: _Evaluator, structs: list[TrainingPlan], tier: Tier, *, keep: int):
    entries = []
    for index, s in enumerate(structs):
        micros = micro_batch_options(ev.request, s.dp)
        times = [ev.speed(with_micro(s, m)).step_time_s for m in micros]
        entries.append((min(times), index, s, micros, times))
    entries.sort(key=lambda e: (e[0], e[1]))
    found: list[Candidate] = []
    found_times: list[float] = []
    rejected: list[Rejection] = []
    for bound, _, s, micros, times in entries:
        if len(found) >= keep and bound >= found_times[keep - 1]:
            break
        first = with_micro(s, micros[0])
        est, why, over = ev.check(first)
        if why:
            rejected.append(_rejection(first, est, why, over, bound))
            continue
        lo, hi = 0, len(micros) - 1          # lo fits; find the largest index that fits
        limit = ""
        while lo < hi:
            mid = (lo + hi + 1) // 2
            _, mid_why, _ = ev.check(with_micro(s, micros[mid]))
            if mid_why:
                hi = mid - 1
                limit = f"micro {micros[mid]}: {mid_why}"
            else:
                lo = mid
        if lo + 1 < len(micros):
            _, nxt_why, _ = ev.check(with_micro(s, micros[lo + 1]))
            limit = f"micro {micros[lo + 1]}: {nxt_why}"
        best = min(range(lo + 1), key=lambda j: (times[j], -j))
        plan = with_micro(s, micros[best])
        est, _, _ = ev.check(plan)
        cand = Candidate(plan=plan, memory=est, speed=ev.speed(plan), tier=tier.name,
                         micro_limit=limit if best == lo else "")
        pos = bisect.bisect_right(found_times, cand.speed.step_time_s)
        found.insert(pos, cand)
        found_times.insert(pos, cand.speed.step_time_s)
    rejected.sort(key=lambda r: r.step_time_s)
    return found, rejected


def _search_memory(ev: _Evaluator, structs: list[TrainingPlan], tier: Tier):
    found: list[Candidate] = []
    rejected: list[Rejection] = []
    for s in structs:
        est, why, over = ev.check(s)
        speed = ev.speed(s)
        if why:
            rejected.append(_rejection(s, est, why, over, speed.step_time_s))
        else:
            found.append(Candidate(plan=s, memory=est, speed=speed, tier=tier.name))
    grain = max(1, int(0.01 * ev.budget))
    found.sort(key=lambda c: (c.memory.reserved_peak_bytes // grain, c.speed.step_time_s))
    rejected.sort(key=lambda r: r.reserved_peak_bytes)
    return found, rejected


def _rejection(plan, est, why, over, bound) -> Rejection:
    return Rejection(plan=plan, reason=why, overshoot=over, step_time_s=bound,
                     reserved_peak_bytes=est.reserved_peak_bytes if est else 0,
                     host_bytes_per_node=est.host_bytes_per_node if est else 0)


def _shape_key(plan: TrainingPlan) -> tuple:
    return (plan.zero_stage, plan.offload_optimizer, plan.offload_params, plan.precision, plan.optimizer,
            plan.checkpointing, plan.tp, plan.pp)


def _distinct(cands: list[Candidate], chosen: Candidate, limit: int) -> list[Candidate]:
    """Top alternatives that differ from the chosen plan and each other in more than a tuning knob."""
    seen = {_shape_key(chosen.plan)}
    out = []
    for c in cands:
        key = _shape_key(c.plan)
        if key not in seen:
            seen.add(key)
            out.append(c)
        if len(out) == limit:
            break
    return out


def _no_fit(request: Request, ev: _Evaluator, rejected: list[Rejection]) -> NoPlanFits:
    hw = request.hardware
    misses: list[Rejection] = []
    seen = set()
    for r in sorted(rejected, key=lambda r: (r.overshoot, r.step_time_s)):
        key = _shape_key(r.plan)
        if key in seen or r.overshoot == float("inf"):
            continue
        seen.add(key)
        misses.append(replace(r, needs=_needs(request, ev, r)))
        if len(misses) == 3:
            break
    what = (f"no plan fits {request.model.name} on {hw.num_gpus} x {hw.gpu.name} "
            f"(budget {ev.budget / GIB:.1f} GiB per GPU after {request.headroom:.0%} headroom, "
            f"host RAM {hw.host_ram_bytes_per_node / GIB:.0f} GiB per node)")
    if misses:
        best = misses[0]
        what += f"; nearest: {best.label}: {best.reason}"
        if best.needs:
            what += f"; it needs {' or '.join(best.needs)}"
    return NoPlanFits(what, tuple(misses))


def _needs(request: Request, ev: _Evaluator, miss: Rejection) -> tuple[str, ...]:
    """What would make `miss` fit: a bigger GPU, more GPUs (ZeRO shards with dp), more host RAM."""
    hw = request.hardware
    needs = []
    if miss.reserved_peak_bytes > ev.budget:
        need_device = miss.reserved_peak_bytes / (1.0 - request.headroom)
        needs.append(f"a GPU with >= {need_device / GIB:.1f} GiB")
        if miss.plan.zero_stage >= 1 or miss.plan.dp > 1:
            for factor in (2, 4, 8, 16, 32, 64):
                total = hw.num_gpus * factor
                per_node = min(max(hw.num_gpus_per_node, 8), total)
                bigger = replace(hw, num_gpus_per_node=per_node, num_nodes=total // per_node)
                plan = miss.plan.with_(dp=miss.plan.dp * factor, micro_batch_size=1, grad_accum=1)
                try:
                    est = ev.estimator(request.model, plan, bigger)
                except MemkitError:
                    break
                if est.reserved_peak_bytes <= ev.budget and est.host_bytes_per_node <= bigger.host_ram_bytes_per_node:
                    needs.append(f"{total} x {hw.gpu.name} (micro-batch 1)")
                    break
    if miss.host_bytes_per_node > hw.host_ram_bytes_per_node:
        needs.append(f">= {miss.host_bytes_per_node / GIB:.0f} GiB host RAM per node (--host-ram)")
    if miss.plan.micro_batch_size == 1 and miss.reserved_peak_bytes > ev.budget:
        needs.append("a shorter --seq-len (micro-batch is already 1)")
    return tuple(needs)
