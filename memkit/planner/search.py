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

Model splits (tp/pp > 1, unpinned): a tier is searched over the data-parallel layouts and the
split layouts apart. With split 'if-needed' the splits are searched only when no data-parallel
plan fits; with 'auto' (the default) a split also wins when the step-time model prices it faster
than the best data-parallel plan by more than the model's measured ranking uncertainty
(estimate.throughput.step_time_ranking_uncertainty: p75 error of the predicted ratio of two
published runs of one source, model and GPU), since a split is the
riskier run (a tp checkpoint is also tied to its layout: memkit.plan.parallel.SPLIT_LIMITS). Batch
arithmetic alone never picks a split
(planner.space.layouts says which nearby global batches work instead). `SearchResult.split_reason`
says why a split was chosen. A split keeps the numerics (AdamW and the same precision), so it
comes before the lean tier.
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field, replace

from memkit.errors import MemkitError, NoFeasiblePlan
from memkit.estimate.bounds import QUANTILE_LABEL, margin
from memkit.estimate.result import MemoryEstimate
from memkit.estimate.throughput import StepTimeEstimate, estimate_step_time, step_time_ranking_uncertainty
from memkit.plan.parallel import split_name
from memkit.planner import backward
from memkit.plan.plan import TrainingPlan
from memkit.planner.space import (QUANTIZED_TIER, Request, Tier, describe, layouts, micro_batch_options, pins,
                                  structures, tiers, unasked, with_micro)
from memkit.spec.stack import Stack
from memkit.units import GIB


class _OfAPlan:
    """A verdict on one plan, labelled as the plan (planner/space.py describe)."""

    __slots__ = ()

    @property
    def label(self) -> str:
        return describe(self.plan)


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate(_OfAPlan):
    """A plan that fits, with its memory and speed estimates."""

    plan: TrainingPlan
    memory: MemoryEstimate
    speed: StepTimeEstimate
    tier: str
    micro_limit: str = ""
    """Why the micro-batch is not larger ('' when the per-rank batch itself is the limit); filled
    for the chosen plan (_with_limit: it may cost one memory estimate)."""
    limit_plan: TrainingPlan | None = None
    """The next larger micro-batch of the same structure, which does not fit (None: none larger)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejection(_OfAPlan):
    """A plan that does not fit, and why."""

    plan: TrainingPlan
    reason: str
    device_peak_bytes: int
    """nvidia-smi peak per GPU (0 when pruned, see `exact`)."""
    host_bytes_per_node: int
    overshoot: float
    """Worst of need/limit over device memory, host RAM and NVMe (> 1 means it does not fit)."""
    step_time_s: float
    """The step time this structure could have reached if memory allowed (the search bound)."""
    needs: tuple[str, ...] = ()
    """What would make it fit (filled for the nearest misses when nothing fits)."""
    exact: bool = True
    """False when pruned by a sibling's verdict (its bytes are then unknown, 0)."""
    floored: bool = False
    """Its own verdict, but found by its peak floor alone (_Evaluator.floor_fails): reason and
    overshoot are the floor's (overshoot a lower bound of the exact one) until _exact estimates it."""


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
    split_reason: str = ""
    """Why the chosen plan splits the model (tp or pp > 1); '' when it does not."""
    num_step_times: int = 0
    """Step-time estimates made (plans priced by estimate_step_time, each once: _Evaluator.speed)."""


class NoPlanFits(NoFeasiblePlan):
    """No plan fits: carries the nearest misses and what each would need (CLI exit code 3)."""

    def __init__(self, message: str, misses: tuple[Rejection, ...]):
        super().__init__(message)
        self.misses = misses


@dataclass(frozen=True, slots=True)
class _Verdict:
    estimate: MemoryEstimate | None
    reason: str
    """Why it does not fit ('' when it fits)."""
    overshoot: float
    device_fails: bool
    host_fails: bool


def device_peak_bytes(est: MemoryEstimate) -> int:
    """What the budget is compared with: the nvidia-smi peak (reserved pool + CUDA context), the
    whole of what the process takes from the device."""
    return est.nvidia_smi_peak_bytes


class _Evaluator:
    """Memoised memory estimates and the feasibility verdict for one request."""

    def __init__(self, request: Request, estimator, *, fit_upper: bool = True, memo: "_Memo | None" = None,
                 stack: "Stack | None" = None):
        self.request = request
        self.estimator = estimator
        self.stack = stack
        """The software versions step time is priced for (--stack; None: the installed behaviours)."""
        self.fit_upper = fit_upper
        self.budget = request.budget_bytes
        self.memo = memo or _Memo()
        self._cache: dict[TrainingPlan, _Verdict] = {}
        from memkit.estimate.memory import estimate_memory

        # The lower bounds below are facts about memkit's own estimator (a --stack partial of it too).
        self.bounded = estimate_memory in (estimator, getattr(estimator, "func", None))
        keywords = getattr(estimator, "keywords", {})
        self.floored = self.bounded and set(keywords) <= {"stack"}  # peak_floor_bytes prices the same
        self._stack_kw = keywords.get("stack")
        self.num_floored = 0
        """Plans found not to fit by their peak floor alone (fails), without a memory estimate."""

    @property
    def num_calls(self) -> int:
        return self.memo.num_calls

    def check(self, plan: TrainingPlan) -> _Verdict:
        hit = self._cache.get(plan)
        if hit is not None:
            return hit
        hw = self.request.hardware
        est = self.memo.estimates.get(plan)
        if est is None and self.bounded:
            out = _pipeline_buffers_miss(self.request, plan, self.budget)
            if out is not None:
                self._cache[plan] = out
                return out
        if est is None:
            self.memo.num_calls += 1
            try:
                est = self.estimator(self.request.model, plan, hw)
            except MemkitError as exc:  # the estimator refuses a combination: a rejection, not a crash
                est = str(exc)
            self.memo.estimates[plan] = est
        if isinstance(est, str):
            out = _Verdict(None, est, float("inf"), True, True)
            self._cache[plan] = out
            return out
        device = device_peak_bytes(est) / self.budget
        # The upper bound (prediction + the bounds.QUANTILE margin, estimate/bounds.py) must fit the device itself:
        # the headroom is what absorbs memkit's error.
        upper = est.nvidia_smi_peak_upper_bytes / hw.gpu.memory_bytes
        upper_fails = self.fit_upper and upper > 1.0 >= device
        host = est.host_bytes_per_node / hw.host_ram_bytes_per_node
        nvme = est.nvme_bytes_per_node / hw.nvme_bytes_per_node if hw.nvme_bytes_per_node else 0.0
        ratios = [(device, f"{device_peak_bytes(est) / GIB:.1f} GiB > {self.budget / GIB:.1f} GiB budget"),
                  (host, f"host RAM {est.host_bytes_per_node / GIB:.1f} GiB > "
                         f"{hw.host_ram_bytes_per_node / GIB:.1f} GiB per node"),
                  (nvme, f"NVMe {est.nvme_bytes_per_node / GIB:.1f} GiB > "
                         f"{hw.nvme_bytes_per_node / GIB:.1f} GiB per node")]
        if upper_fails:
            ratios.append((upper, f"upper bound {est.nvidia_smi_peak_upper_bytes / GIB:.1f} GiB "
                                  f"(+{est.upper_margin:.0%}) > {hw.gpu.memory_bytes / GIB:.1f} GiB device"))
        worst, why = max(ratios, key=lambda r: r[0])
        out = _Verdict(est, why if worst > 1.0 else "", worst, device > 1.0 or upper_fails, host > 1.0 or nvme > 1.0)
        self._cache[plan] = out
        return out

    def fails(self, plan: TrainingPlan) -> bool:
        """Whether `plan` does not fit: check(plan).reason != '', but first, for a plan not yet
        estimated, its closed-form peak floor (estimate/memory.py peak_floor_bytes, <= the exact
        nvidia-smi peak): over the budget, or with the upper-bound margin over the device, means it
        does not fit either way, and the allocator replay is skipped. For the searches that only
        need the verdict (the micro-batch and K bisections); a floored plan is estimated later
        only if its reason is shown."""
        if plan in self._cache or plan in self.memo.estimates or not self.floored:
            return bool(self.check(plan).reason)
        if self.floor_fails(plan) is not None:
            self.num_floored += 1
            return True
        return bool(self.check(plan).reason)

    def floor_fails(self, plan: TrainingPlan, *, host_fits: bool = False) -> "_Verdict | None":
        """A device verdict from the peak floor alone (see fails), None when the floor does not
        decide. Its overshoot, floor / budget, is a lower bound of the exact verdict's (which is the
        worst ratio, device peak / budget among them). host_fits: decide only where the estimate's
        host RAM and NVMe bytes are known without it (one stage: estimate/memory.py
        peak_floor_and_host) and fit, so that the verdict's host_fails (False) is the exact one."""
        if not self.floored:
            return None
        floors = self.memo.floors.get(plan)
        if floors is None:
            from memkit.estimate.memory import peak_floor_and_host

            try:
                floors = peak_floor_and_host(self.request.model, plan, self.request.hardware, stack=self._stack_kw)
            except MemkitError:
                floors = (0, None, None)  # the estimator says it in its own words
            self.memo.floors[plan] = floors
        floor, host, nvme = floors
        gpu_bytes = self.request.hardware.gpu.memory_bytes
        if not (floor > self.budget or (self.fit_upper and int(floor * (1 + margin(plan))) > gpu_bytes)):
            return None
        if host_fits:
            hw = self.request.hardware
            if host is None or host > hw.host_ram_bytes_per_node or (
                    hw.nvme_bytes_per_node and nvme > hw.nvme_bytes_per_node):
                return None
        return _Verdict(None, f"at least {floor / GIB:.1f} GiB (its peak floor) > {self.budget / GIB:.1f} GiB "
                              "budget or, with its upper-bound margin, the device", floor / self.budget, True, False)

    def structures(self, tier: Tier, layout: tuple[int, int, int]) -> list[TrainingPlan]:
        """planner.space.structures, memoised for the request (_Memo.structures)."""
        key = (tier, layout)
        hit = self.memo.structures.get(key)
        if hit is None:
            hit = self.memo.structures[key] = structures(self.request, tier, layout)
        return hit

    def speed_at(self, s: TrainingPlan, micro: int) -> float:
        """ev.speed(with_micro(s, micro)).step_time_s, memoised on (s, micro) (_Memo.micro_speeds)."""
        key = (s, micro)
        hit = self.memo.micro_speeds.get(key)
        if hit is None:
            hit = self.memo.micro_speeds[key] = self.speed(with_micro(s, micro)).step_time_s
        return hit

    def speed(self, plan: TrainingPlan) -> StepTimeEstimate:
        """Memoised: the search asks for the same plan's step time several times (its bound, its
        micro-batch choice, the partial-checkpointing loop), and the model is a pure function."""
        hit = self.memo.speeds.get(plan)
        if hit is None:
            hit = self.memo.speeds[plan] = estimate_step_time(self.request.model, plan, self.request.hardware,
                                                                   stack=self.stack)
        return hit


PIPELINE_REPLAY_ACCUM = 1024
"""Gradient accumulation above which a pipeline plan is first checked against a closed-form lower
bound: the replay allocates one receive buffer per micro-batch (estimate/pipeline.py
stage_buffers), so its cost grows with the accumulation (seconds at 10^4, hours at 10^8)."""


def _pipeline_buffers_miss(request: Request, plan: TrainingPlan, budget: int) -> "_Verdict | None":
    """The verdict of a pipeline plan with a long accumulation whose receive buffers alone exceed
    the budget, without the replay; None when the bound does not decide (then the plan is estimated).

    The bound: stage 0 (not the last when pp > 1) holds (in flight + 1 + m) stage-boundary tensors,
    one block input each, at every moment (estimate/pipeline.py stage_buffers, held_bytes), so its
    allocated peak -- and the estimate's, the worst stage's nvidia-smi peak -- is at least
    m x one block input (estimate/activations.py block_activations, input_bytes)."""
    if plan.pp == 1 or plan.grad_accum <= PIPELINE_REPLAY_ACCUM:
        return None
    from memkit.estimate.activations import block_activations

    try:
        floor = plan.grad_accum * block_activations(request.model, plan).input_bytes
    except MemkitError:
        return None  # the estimator says it in its own words
    if floor <= budget:
        return None
    return _Verdict(None, f"at least {floor / GIB:.1f} GiB > {budget / GIB:.1f} GiB budget (the pipeline's "
                          f"{plan.grad_accum} micro-batch receive buffers alone)", floor / budget, True, False)


@dataclass(slots=True)
class _Memo:
    """Memory and step-time estimates of one request's plans, kept across search()'s two passes
    (the estimates do not depend on whether the upper bound must fit; only the verdicts do)."""

    estimates: dict = field(default_factory=dict)
    """plan -> MemoryEstimate, or the estimator's refusal (its message)."""
    speeds: dict = field(default_factory=dict)
    floors: dict = field(default_factory=dict)
    """plan -> its peak floor (estimate/memory.py peak_floor_bytes), for _Evaluator.fails."""
    structures: dict = field(default_factory=dict)
    """(tier, layout) -> planner.space.structures of it: both passes (and _run's retry without the
    unasked plans) search the same structures, and building them validates every plan."""
    bounds: dict = field(default_factory=dict)
    """structure -> (its micro-batch options, _bound of it)."""
    dominators: dict = field(default_factory=dict)
    """structure -> _dominators of it (plans derived once per request, not at every _bound_order)."""
    micro_speeds: dict = field(default_factory=dict)
    """(structure, micro-batch) -> step time (s): _Evaluator.speed_at's memo, which skips deriving
    the plan (with_micro) for the step times the bounds and the micro-batch choice re-read."""
    num_calls: int = 0
    """Memory estimates made (cache misses)."""


UPPER_BOUND_FALLBACK_NOTE = (f"no plan keeps its {QUANTILE_LABEL} upper bound inside the device; chose the best plan whose "
                             "prediction fits the budget -- it may run out of memory (see its upper bound)")


def search(request: Request, *, estimator=None, num_alternatives: int = 4,
           num_rejections: int = 6, stack: "Stack | None" = None) -> SearchResult:
    """The best plan for `request`; NoPlanFits when none fits, MemkitError for bad input. A plan
    fits when its prediction is inside the budget and its upper bound (estimate/bounds.py) inside the device; when
    no plan does both, the best one inside the budget is chosen and the result says so. `stack`:
    the versions step time is priced for (estimate_step_time's stack), as `estimator` prices memory."""
    memo = _Memo()
    try:
        return _search(request, estimator=estimator, num_alternatives=num_alternatives,
                       num_rejections=num_rejections, fit_upper=True, memo=memo, stack=stack)
    except _NothingFits as strict:
        try:
            result = _search(request, estimator=estimator, num_alternatives=num_alternatives,
                             num_rejections=num_rejections, fit_upper=False, memo=memo, stack=stack)
        except _NothingFits:
            raise strict.answer() from None
        return replace(result, notes=result.notes + (UPPER_BOUND_FALLBACK_NOTE,))


class _NothingFits(Exception):
    """A pass of the search found no plan; `answer()` builds the NoPlanFits the user sees (its
    nearest misses cost estimates of their own, so only for the pass whose answer is shown)."""

    def __init__(self, request: Request, ev: "_Evaluator", rejected: list):
        super().__init__("no plan fits")
        self.answer = lambda: _no_fit(request, ev, rejected)


def _search(request: Request, *, estimator, num_alternatives: int, num_rejections: int,
            fit_upper: bool, memo: "_Memo", stack: "Stack | None" = None) -> SearchResult:
    if estimator is None:
        from memkit.estimate.memory import estimate_memory as estimator
    request.validate()
    lays = layouts(request)
    notes: list[str] = []
    num_gpus = request.hardware.num_gpus
    if request.global_batch_size % num_gpus and all(dp < num_gpus for _, _, dp in lays):
        notes.append(f"global batch {request.global_batch_size} is not divisible by {num_gpus} GPUs; only "
                     f"layouts with data-parallel degree {sorted({dp for _, _, dp in lays})} are possible")
    ev = _Evaluator(request, estimator, fit_upper=fit_upper, memo=memo, stack=stack)
    all_rejected: list[Rejection] = []
    num_structures = 0
    tier_list = tiers(request)
    phases = _phases(request, lays)
    request_notes = tuple(notes)
    for i, tier in enumerate(tier_list):
        tier_rejected: list[Rejection] = []
        plain_found: list[Candidate] = []
        for phase_index, phase in enumerate(phases):
            structs = [s for lay in phase for s in ev.structures(tier, lay)]
            num_structures += len(structs)
            found, rejected = _run(ev, structs, tier, keep=num_alternatives + 2)
            tier_rejected += rejected
            if len(phases) > 1 and phase_index == 0:  # the data-parallel layouts
                plain_found = found
                if not (found and request.split == "if-needed"):
                    continue  # compare with the splits (or fall back to them) first
            elif plain_found:
                found, split_note = _prefer_data_parallel(plain_found, found, objective=request.objective)
                notes += [split_note] if split_note else []
            if not found:
                continue
            if i > 0 and tier.name == QUANTIZED_TIER:
                notes.append(quantized_note(found[0].plan, None))
            elif i > 0:
                notes.append(f"no {tier_list[0].name}-tier plan (AdamW, mixed precision or fp32) fits; "
                             f"chose from the {tier.name} tier (pure bf16 / 8-bit AdamW / Adafactor)")
            found, risk_note = _prefer_low_risk(request, found)
            notes += [risk_note] if risk_note else []
            chosen = found[0] = _with_limit(ev, found[0])
            notes += _technique_notes(ev, chosen.plan)
            alternatives = _distinct(found[1:], chosen, num_alternatives)
            # Rejected plans that would have been faster: the "why not X?" the CLI answers.
            better = [r for r in tier_rejected if r.step_time_s < chosen.speed.step_time_s]
            better = _distinct_rejections(ev, better, num_rejections)
            reason = ""
            if chosen.plan.tp > 1 or chosen.plan.pp > 1:
                reason = _split_reason(request, ev, tier, chosen, lays, plain_found=plain_found,
                                       earlier=tier_rejected)
            result = SearchResult(request=request, chosen=chosen, alternatives=tuple(alternatives),
                                  rejected=tuple(better), notes=tuple(notes), num_structures=num_structures,
                                  num_memory_estimates=ev.num_calls, split_reason=reason,
                                  num_step_times=len(ev.memo.speeds))
            if tier.name != QUANTIZED_TIER and tier_list[-1].name == QUANTIZED_TIER and _offloads(chosen.plan):
                result = _quantized_instead(ev, tier_list[-1], [lay for lay in lays if not _is_split(lay)],
                                            result, keep=num_alternatives + 2, notes=request_notes) or result
            return result
        all_rejected += tier_rejected
    raise _NothingFits(request, ev, all_rejected)


def _with_limit(ev: "_Evaluator", cand: Candidate) -> Candidate:
    """`cand` with its micro_limit in the evaluator's words: the next micro-batch's reason, exact
    (the bisection may have rejected it on its peak floor alone, _Evaluator.fails)."""
    if cand.limit_plan is None or cand.micro_limit:
        return cand
    return replace(cand, micro_limit=f"micro {cand.limit_plan.micro_batch_size}: {ev.check(cand.limit_plan).reason}")


def _offloads(plan: TrainingPlan) -> bool:
    return plan.offload_optimizer != "none" or plan.offload_params != "none"


def _quantized_instead(ev: "_Evaluator", tier: Tier, lays, offloaded: SearchResult, *, keep: int,
                       notes: tuple[str, ...] = ()) -> SearchResult | None:
    """The QLoRA rule for an unpinned LoRA request: a 4-bit base changes the frozen weights'
    numerics (QLoRA Sec. 4-5 report 16-bit LoRA parity with NF4 + double quantisation, on their
    benchmarks only), so it is tried only when the fastest 16-bit-base plan that fits must offload
    to the host, and chosen when the step-time model prices it faster than that plan."""
    structs = [s for lay in lays for s in ev.structures(tier, lay)]
    found, _rejected = _run(ev, structs, tier, keep=keep)
    if not found or found[0].speed.step_time_s >= offloaded.chosen.speed.step_time_s:
        return None
    chosen = _with_limit(ev, found[0])
    notes = [*notes, quantized_note(chosen.plan, offloaded.chosen), *_technique_notes(ev, chosen.plan)]
    return replace(offloaded, chosen=chosen,
                   alternatives=tuple([offloaded.chosen] + _distinct(found[1:], chosen, len(offloaded.alternatives))),
                   rejected=(), notes=tuple(notes), num_structures=offloaded.num_structures + len(structs),
                   num_memory_estimates=ev.num_calls, split_reason="", num_step_times=len(ev.memo.speeds))


def quantized_note(plan: TrainingPlan, offloaded: Candidate | None) -> str:
    """suggest's words for a chosen 4-bit base (memkit/plan/quantize.py)."""
    why = (f"the fastest 16-bit-base LoRA plan that fits offloads ({offloaded.label}, "
           f"{offloaded.speed.step_time_s:.2f} s/step)" if offloaded is not None
           else "no 16-bit-base LoRA plan fits")
    return (f"{plan.quantize_base} 4-bit base (QLoRA, bitsandbytes{', double quant' if plan.double_quant else ''}): "
            f"{why}; the frozen weights are stored in 4 bits and dequantised per matmul, which changes "
            "their numerics (chosen because --allow qlora; pin --quantize-base none to refuse it)")


HEADROOM_RISK_FRACTION = 0.05
"""Headroom below this share of device memory counts as a risk: it is the memory estimator's stated
tolerance (tests/e2e/test_parallel_equivalence.py MEMORY_RTOL; the CPU measurements in
tests/golden/cpu_measurements.json are all within 5 %)."""


MOVING_PARTS = (("checkpointing", lambda p: p.checkpointing != "none"),
                ("chunked/fused loss", lambda p: p.loss != "standard"),
                ("optimizer in backward", lambda p: p.optimizer_in_backward),
                ("ZeRO sharding", lambda p: p.zero_stage > 0))
"""Mechanisms a run adds on top of a plain data-parallel step, each one more thing that can
misbehave at run time and one more term whose price the step-time model states
(estimate/step_terms.py): activation checkpointing (Checkpointing), a chunked or fused loss (Loss),
the optimizer stepped inside backward (OptimizerInBackward), sharded optimizer states, gradients
or parameters (ZeRO 1-3 / FSDP: _dp_comm's gathers and reductions)."""


def moving_parts(plan: TrainingPlan) -> int:
    """How many of MOVING_PARTS `plan` has."""
    return sum(bool(has(plan)) for _, has in MOVING_PARTS)


def _risk(request: Request, cand: Candidate) -> tuple[int, int, int, int]:
    """(offloads, model split, tight headroom, moving parts): what can go wrong beyond the
    predicted speed, most serious first."""
    p = cand.plan
    offload = (p.offload_optimizer != "none") + (p.offload_params != "none")
    offload += p.offload_activations != "none"  # pinned host RAM and PCIe traffic too
    headroom = request.hardware.gpu.memory_bytes - device_peak_bytes(cand.memory)
    return (offload, int(p.tp > 1 or p.pp > 1),
            int(headroom < HEADROOM_RISK_FRACTION * request.hardware.gpu.memory_bytes), moving_parts(p))


def _prefer_low_risk(request: Request, found: list[Candidate]) -> tuple[list[Candidate], str]:
    """Among plans predicted within the step-time model's ranking uncertainty of the fastest, put
    the lowest-risk one first (no offload, then no split, then headroom, then fewer moving parts:
    _risk); say so when that changes the pick, and say it is a tie when it does not. The uncertainty
    is measured: benchmarks/throughput_accuracy.py's p75 error of the predicted ratio of two
    published runs (estimate.throughput.step_time_ranking_uncertainty)."""
    if request.objective != "throughput" or len(found) < 2:
        return found, ""
    u = step_time_ranking_uncertainty()
    fastest = found[0]
    close = [c for c in found if c.speed.step_time_s <= fastest.speed.step_time_s * (1 + u)]
    pick = min(close, key=lambda c: (_risk(request, c), c.speed.step_time_s))
    if pick is fastest or _risk(request, pick) == _risk(request, fastest):
        runner = next((c for c in close if c is not fastest and c.label != fastest.label), None)
        return found, (tie_note(fastest, runner, u, _risk_words(request, fastest, runner)) if runner else "")
    margin = step_time_margin(fastest.speed.step_time_s, pick.speed.step_time_s)
    note = (f"tie: chose {pick.label} ({pick.speed.step_time_s:.2f} s/step) over the predicted-fastest "
            f"{fastest.label} ({fastest.speed.step_time_s:.2f} s/step): {margin:.1%} slower, within the "
            f"step-time model's +-{u:.1%} measured ranking uncertainty, and lower risk "
            f"({', '.join(_risk_words(request, pick, fastest))})")
    return [pick] + [c for c in found if c is not pick], note


def _risk_words(request: Request, a: Candidate, b: Candidate) -> list[str]:
    """What a carries less of than b, in _risk's order."""
    words = ("no offload", "no model split", "more memory headroom",
             f"fewer moving parts ({moving_parts(a.plan)} vs {moving_parts(b.plan)}: {_parts_words(a.plan, b.plan)})")
    return [w for w, x, y in zip(words, _risk(request, a), _risk(request, b)) if x < y]


def _parts_words(a: TrainingPlan, b: TrainingPlan) -> str:
    """The moving parts (MOVING_PARTS) b has and a does not."""
    return "no " + ", no ".join(name for name, has in MOVING_PARTS if has(b) and not has(a))


def step_time_margin(chosen_s: float, other_s: float) -> float:
    """How much slower the other plan is predicted to be, as a share of the chosen plan's step time."""
    return other_s / chosen_s - 1.0


def tie_note(kept: Candidate, runner: Candidate, u: float, lower_risk: list[str]) -> str:
    """Item 5 of issue 21: a pick whose runner-up is predicted within the step-time model's measured
    uncertainty is a tie, not a ranking; say so, and on what the kept plan won."""
    margin = step_time_margin(kept.speed.step_time_s, runner.speed.step_time_s)
    why = (f"kept it for lower risk ({', '.join(lower_risk)})" if lower_risk
           else "equal risk, so the predicted-faster plan is kept; either is a sound choice")
    return (f"tie: {kept.label} ({kept.speed.step_time_s:.2f} s/step) and {runner.label} "
            f"({runner.speed.step_time_s:.2f} s/step) differ by {margin:.1%}, within the step-time model's "
            f"+-{u:.1%} measured ranking uncertainty; {why}")


def _run(ev: "_Evaluator", structs: list[TrainingPlan], tier: Tier, *, keep: int):
    if ev.request.objective == "memory":
        found, rejected = _search_memory(ev, structs, tier)
    else:
        found, rejected = _search_throughput(ev, structs, tier, keep=keep)
    if any(unasked(ev.request, c.plan) for c in found):  # estimated, never chosen or offered (space.unasked)
        allowed = [s for s in structs if not unasked(ev.request, s)]
        found = _run(ev, allowed, tier, keep=keep)[0] if allowed else []
    return found, rejected


def _is_split(layout: tuple[int, int, int]) -> bool:
    return layout[0] > 1 or layout[1] > 1


def _phases(request: Request, lays: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Layout groups searched in order within a tier: data parallel, then the splits (under
    'if-needed' only if data parallel finds nothing). One group when there is only one kind."""
    plain = [lay for lay in lays if not _is_split(lay)]
    split = [lay for lay in lays if _is_split(lay)]
    if not plain or not split:
        return [lays]
    return [plain, split]


def _prefer_data_parallel(plain: list[Candidate], split: list[Candidate], *,
                          objective: str) -> tuple[list[Candidate], str]:
    """Data-parallel and split plans that fit, best first, with a split ahead of the best
    data-parallel plan only when it is faster by more than the step-time model's measured
    uncertainty (throughput objective) or has the lower peak (memory objective); and a note when a
    faster split was passed over because its gain is within that uncertainty."""
    if not split:
        return plain, ""
    best, rival = plain[0], split[0]
    if objective == "memory":
        split_wins = rival.memory.nvidia_smi_peak_bytes < best.memory.nvidia_smi_peak_bytes
        return (split + plain if split_wins else plain + split), ""
    u = step_time_ranking_uncertainty()
    if rival.speed.step_time_s * (1.0 + u) < best.speed.step_time_s:
        return split + plain, ""
    note = ""
    if rival.speed.step_time_s < best.speed.step_time_s:
        note = (f"kept {best.label} ({best.speed.step_time_s:.2f} s/step) over the split {rival.label} "
                f"({rival.speed.step_time_s:.2f} s/step): the gain is within the step-time model's +-{u:.1%} "
                f"measured ranking uncertainty, and lower risk (no model split)")
    return plain + split, note


_TERM_WORDS = {
    "dp_comm": "data-parallel communication (ZeRO gathers and gradient reductions)",
    "offload_transfer": "offload traffic over PCIe",
    "host_overhead": "per-layer host overhead (ZeRO-3 hooks)",
    "recompute": "activation recomputation",
    "optimizer_step": "the optimizer step",
    "compute": "compute at a small micro-batch",
}


def _split_reason(request: Request, ev: "_Evaluator", tier: Tier, chosen: Candidate,
                  lays: list[tuple[int, int, int]], *, plain_found: list[Candidate],
                  earlier: list[Rejection]) -> str:
    """One line: why the chosen plan splits the model (pinned, nothing else fits, or faster by
    more than the step-time model's measured uncertainty)."""
    name = split_name(chosen.plan)
    pinned = [f"--{k} {getattr(request, k)}" for k in ("tp", "pp")
              if getattr(request, k) is not None and getattr(request, k) > 1]
    if pinned:
        return f"{name}: pinned by {' '.join(pinned)}"
    if not plain_found:
        misses = [r for r in earlier if not _is_split((r.plan.tp, r.plan.pp, r.plan.dp)) and r.overshoot != float("inf")]
        nearest = min((_exact(ev, r) for r in misses), key=lambda r: r.overshoot, default=None)
        if nearest is None:
            return f"{name}: no data-parallel plan fits"
        return f"{name}: does not fit otherwise (nearest data-parallel plan {nearest.label}: {nearest.reason})"
    best = plain_found[0]
    if request.objective == "memory":
        return (f"{name}: lowest per-GPU peak ({chosen.memory.nvidia_smi_peak_bytes / GIB:.1f} GiB vs "
                f"{best.memory.nvidia_smi_peak_bytes / GIB:.1f} GiB for {best.label})")
    ours, theirs = chosen.speed.components_s, best.speed.components_s
    term = max(_TERM_WORDS, key=lambda k: theirs.get(k, 0.0) - ours.get(k, 0.0))
    ratio = best.speed.step_time_s / chosen.speed.step_time_s
    return (f"{name}: {ratio:.2f}x faster than the best data-parallel plan ({best.label}, "
            f"{best.speed.step_time_s:.2f} s/step vs {chosen.speed.step_time_s:.2f}) by the step-time model, "
            f"more than its {step_time_ranking_uncertainty():.1%} measured ranking uncertainty; it saves {_TERM_WORDS[term]}: "
            f"{theirs.get(term, 0.0):.2f} s vs {ours.get(term, 0.0):.2f} s per step")


class _Pruner:
    """Skips memory estimates whose verdict is already known. Two monotonicity facts, checked
    against the estimator by tests/unit/test_planner_assumptions.py:
      (a) at a fixed ZeRO stage, precision, optimizer and layout, device memory does not grow
          with more offload, with checkpointing, or with overlap_comm off; it grows with the
          micro-batch (hence the binary search);
      (b) host RAM does not depend on checkpointing, overlap_comm or the micro-batch, and does not
          shrink with more CPU offload (offloading moves bytes to the host).
    So if the leanest plan of a (ZeRO stage, precision, optimizer, layout) group misses the
    device budget, the whole group does (a); if one plan misses host RAM, so do its
    checkpointing / overlap / micro-batch siblings and its more-offloaded (CPU) siblings (b).
    ZeRO stages are not ordered: ZeRO-3's prefetch buffers can exceed ZeRO-2's full 16-bit
    weights on small models, and ZeRO-1 on one GPU keeps more than DeepSpeed's ZeRO-0."""

    def __init__(self, ev: _Evaluator, structs: list[TrainingPlan]):
        self.ev = ev
        self.leanest: dict[tuple, TrainingPlan] = {}
        for s in structs:
            key = _group_key(s)
            if key not in self.leanest or _lean_rank(s) > _lean_rank(self.leanest[key]):
                self.leanest[key] = s
        self.device_dead: dict[tuple, Rejection] = {}
        self.host_dead: dict[tuple, Rejection] = {}

    def known_miss(self, plan: TrainingPlan, bound: float) -> Rejection | None:
        group = _group_key(plan)
        if group not in self.device_dead:
            lean = self.leanest[group]
            # Throughput objective: the floor may decide, and the leanest plan is estimated only if
            # its rejection is shown (_exact). The memory objective ranks rejections by overshoot.
            floored = (self.ev.floor_fails(lean) if self.ev.request.objective == "throughput"
                       and lean not in self.ev.memo.estimates else None)
            if floored is not None:
                self.device_dead[group] = replace(_rejection(lean, floored, bound), floored=True)
            else:
                v = self.ev.check(lean)
                self.device_dead[group] = (_rejection(lean, v, bound) if v.device_fails else None)
        dead = self.device_dead[group]
        if dead is not None and plan != dead.plan:
            return Rejection(plan=plan, reason=f"needs more than {dead.label}, which {dead.reason}",
                             device_peak_bytes=0, host_bytes_per_node=0, overshoot=dead.overshoot,
                             step_time_s=bound, exact=False)
        if dead is not None:
            return replace(dead, step_time_s=bound)
        host = self.host_dead.get(_host_key(plan))
        if host is not None and _cpu_offload_level(plan) >= _cpu_offload_level(host.plan):
            return Rejection(plan=plan, reason=f"{host.reason} (as {host.label})", device_peak_bytes=0,
                             host_bytes_per_node=host.host_bytes_per_node, overshoot=host.overshoot,
                             step_time_s=bound, exact=False)
        return None

    def record(self, plan: TrainingPlan, verdict: _Verdict, rejection: Rejection) -> None:
        if verdict.host_fails and verdict.estimate is not None and _cpu_offload_level(plan) >= 0:
            key = _host_key(plan)
            known = self.host_dead.get(key)
            if known is None or _cpu_offload_level(plan) < _cpu_offload_level(known.plan):
                self.host_dead[key] = rejection


def _group_key(plan: TrainingPlan) -> tuple:
    return (plan.zero_stage, plan.precision, plan.optimizer, plan.tp, plan.pp, plan.dp)


def _host_key(plan: TrainingPlan) -> tuple:
    return (plan.zero_stage, plan.precision, plan.optimizer, plan.tp, plan.pp, plan.dp)


def _cpu_offload_level(plan: TrainingPlan) -> int:
    """0 none, 1 optimizer to CPU, 2 optimizer and params to CPU; -1 for NVMe (not ordered) and for
    activation offload, whose host bytes follow the activations, not the offload level."""
    if "nvme" in (plan.offload_optimizer, plan.offload_params) or plan.offload_activations != "none":
        return -1
    return (plan.offload_optimizer == "cpu") + (plan.offload_params == "cpu")


def _lean_rank(plan: TrainingPlan) -> tuple:
    offload = (plan.offload_optimizer != "none") + (plan.offload_params != "none")
    offload += plan.offload_activations != "none"
    return (offload, plan.checkpointing == "full", plan.loss != "standard", not plan.overlap_comm)


def _bound(ev: _Evaluator, s: TrainingPlan, micros: tuple[int, ...]) -> float:
    """The best step time any micro-batch of structure `s` could reach (the search's bound)."""
    hit = ev.memo.bounds.get(s)
    if hit is not None and hit[0] == micros:
        return hit[1]
    # a partial-checkpointing plan can be as fast as no checkpointing
    bound = _fastest(ev, s.with_(checkpointing="none") if _tries_partial(ev, s) else s, micros)
    ev.memo.bounds[s] = (micros, bound)
    return bound


def _fastest(ev: _Evaluator, s: TrainingPlan, micros: tuple[int, ...]) -> float:
    """min(ev.speed_at(s, m) for m in micros), pricing only the micro-batches that can hold it when
    `s` has a dominator (_dominators: at every micro-batch its step time is at most s's): the
    leanest one, `root`, is priced at all of them, and s's own times are read in ascending order
    of root's, up to the first micro-batch whose root time is no less than the least s time found
    -- every later one has s time >= root time >= that least one, so the minimum is exact."""
    doms = _dominators_of(ev, s)
    if not doms:
        return min(ev.speed_at(s, m) for m in micros)
    root = doms[-1]  # s without activation offload, with overlap_comm on (ZeRO-1/2): below every other
    floors = sorted((ev.speed_at(root, m), m) for m in micros)
    best = float("inf")
    for floor, m in floors:
        if floor >= best:
            break
        best = min(best, ev.speed_at(s, m))
    return best


def _dominators(s: TrainingPlan) -> list[TrainingPlan]:
    """Structures whose bound is at most `s`'s, at every micro-batch of the same options (the same
    dp, pp and engine): `s` without activation offload, and a ZeRO-1/2 `s` with overlap_comm on.

    - Activation offload: the step-time model adds the PCIe transfer to each micro-step and changes
      nothing else (estimate/throughput.py, step_terms.py ActivationOffload; checked by
      tests/unit/test_planner_assumptions.py).
    - overlap_comm off: estimate/throughput.py _dp_comm is the only step-time term that reads it,
      and there it replaces the exposed reduce time `_overlapped(rs, bwd_s)` by `rs` itself (stage 1
      at the boundary, stage 2 every micro-step); _overlapped(c, w) = max(0, c - w) +
      OVERLAP_COMPUTE_COST * min(c, w) <= c since OVERLAP_COMPUTE_COST < 1, and both terms enter the
      step with positive weights (micro x m x bubble, boundary). Checked by the same test file.
    The partial-checkpointing bound (_bound: the 'none' sibling's times) keeps both relations, as the
    sibling differs in the same knob."""
    out = []
    if s.offload_activations != "none":
        out.append(s.with_(offload_activations="none"))
    if s.zero_stage in (1, 2) and not s.overlap_comm:
        out += [d.with_(overlap_comm=True) for d in [s, *out]]
    return out


def _dominators_of(ev: _Evaluator, s: TrainingPlan) -> list[TrainingPlan]:
    """_dominators(s), derived once per request (_Memo.dominators)."""
    hit = ev.memo.dominators.get(s)
    if hit is None:
        hit = ev.memo.dominators[s] = _dominators(s)
    return hit


def _bound_order(ev: _Evaluator, structs: list[TrainingPlan]):
    """(bound, index, structure, micro-batches) in ascending (bound, index) order, as a generator,
    computing a bound only when the visit may reach it.

    A structure with a dominator in `structs` (_dominators: a sibling whose bound is provably at
    most its own) waits in the heap under that sibling's exact bound and is priced only when
    popped; an item is yielded only when its exact (bound, index) is the heap's least key, and
    every key left is a lower bound of its own exact key, so the order is exactly that of sorting
    all exact bounds - and a search that stops early never prices the rest."""
    heap = []
    exact: dict[TrainingPlan, float] = {}
    waiting = []
    present = set(structs)
    for index, s in enumerate(structs):
        micros = backward.micro_options(s, micro_batch_options(ev.request, s.dp, s.pp))
        if not micros:  # the optimizer in backward needs the whole per-rank batch in one micro-batch
            continue
        doms = _dominators_of(ev, s)
        if any(d in present for d in doms):
            waiting.append((index, s, micros, doms))
            continue
        exact[s] = _bound(ev, s, micros)
        heap.append((exact[s], index, True, s, micros))
    for index, s, micros, doms in waiting:
        floor = max((exact[d] for d in doms if d in exact), default=None)
        if floor is None:
            heap.append((_bound(ev, s, micros), index, True, s, micros))
        else:
            heap.append((floor, index, False, s, micros))
    heapq.heapify(heap)
    while heap:
        key, index, is_exact, s, micros = heapq.heappop(heap)
        if is_exact:
            yield key, index, s, micros
        else:
            heapq.heappush(heap, (_bound(ev, s, micros), index, True, s, micros))


def _search_throughput(ev: _Evaluator, structs: list[TrainingPlan], tier: Tier, *, keep: int):
    pruner = _Pruner(ev, structs)
    found: list[Candidate] = []
    found_times: list[float] = []
    rejected: list[Rejection] = []
    largest: dict[TrainingPlan, int] = {}  # structure -> index of its largest micro-batch that fits
    guesses: dict[tuple, int] = {}  # partial checkpointing's last answer, by loss and activation offload
    twins: dict[TrainingPlan, int] = {}  # ... by structure with overlap_comm on (its overlap / no-overlap twin)
    for bound, _, s, micros in _bound_order(ev, structs):
        if len(found) >= keep and bound >= found_times[keep - 1]:
            break
        known = pruner.known_miss(s, bound)
        if known is not None:
            rejected.append(known)
            continue
        first = with_micro(s, micros[0])
        # The floor may reject it (its host verdict exact, for the pruner's record); the rejection
        # is then estimated only if shown (_exact, _by_overshoot).
        floored = ev.floor_fails(first, host_fits=True) if first not in ev.memo.estimates else None
        if floored is not None:
            rejected.append(replace(_rejection(first, floored, bound), floored=True))
            continue
        v = ev.check(first)
        if v.reason:
            rej = _rejection(first, v, bound)
            pruner.record(s, v, rej)
            rejected.append(rej)
            continue
        lo = _largest_fitting(ev, s, micros)
        largest[s] = lo
        limit = with_micro(s, micros[lo + 1]) if lo + 1 < len(micros) else None
        times = [ev.speed_at(s, m) for m in micros[:lo + 1]]
        best = min(range(lo + 1), key=lambda j: (times[j], -j))
        plan = with_micro(s, micros[best])
        if _tries_partial(ev, s):
            # The micro-batch bisected first (any guess gives the same answer, _partial_checkpointing; a
            # good one saves estimates): the
            # overlap twin's answer (same memory but for the overlap buffers), else the last one of the
            # same loss and activation offload, else the smallest micro-batch that does not fit without
            # checkpointing
            like, twin = (s.loss, s.offload_activations), s.with_(overlap_comm=True)
            guess = twins.get(twin, guesses.get(like, largest.get(s.with_(checkpointing="none"), -1) + 1))
            plan, best = _partial_checkpointing(ev, s, micros, lo, plan, guess=min(guess, lo))
            guesses[like] = twins[twin] = best
        cand = Candidate(plan=plan, memory=ev.check(plan).estimate, speed=ev.speed(plan), tier=tier.name,
                         limit_plan=limit if best == lo else None)
        pos = bisect.bisect_right(found_times, cand.speed.step_time_s)
        found.insert(pos, cand)
        found_times.insert(pos, cand.speed.step_time_s)
    rejected.sort(key=lambda r: r.step_time_s)
    return found, rejected


def _technique_notes(ev: _Evaluator, plan: TrainingPlan) -> list[str]:
    """Why the chosen plan uses the chunked loss / partial checkpointing: what the plan would
    need without it (memkit/plan/techniques.py)."""
    notes = []
    gib = lambda plan_: device_peak_bytes(ev.check(plan_).estimate) / GIB if ev.check(plan_).estimate else 0.0
    if plan.loss == "chunked" and ev.request.loss is None:
        standard = plan.with_(loss="standard")
        why = ev.check(standard).reason or f"{gib(standard):.1f} GiB, fits"  # the evaluator's own words
        notes.append(f"chunked loss: with the full fp32 logits this plan would be {why}, instead of "
                     f"{gib(plan):.1f} GiB; it costs one more LM-head matmul in backward")
    if plan.checkpointing.isdigit():
        k, blocks = int(plan.checkpointing), ev.request.model.total_layers
        fewer = plan.with_(checkpointing=str(k - 1) if k > 1 else "none")
        notes.append(f"checkpointing the first {k} of {blocks} blocks: the fewest that fit "
                     f"({k - 1} blocks: {ev.check(fewer).reason or 'fits'}); the rest keep "
                     "their activations, so only those recompute (Chen et al. 2016)")
    notes += backward.notes(ev, plan, gib)  # activation offload, optimizer in backward
    return notes


def _tries_partial(ev: _Evaluator, s: TrainingPlan) -> bool:
    return s.checkpointing == "full" and ev.request.checkpointing is None and s.pp == 1


def _largest_fitting(ev: "_Evaluator", s: TrainingPlan, micros: list[int]) -> int:
    """Index of the largest micro-batch of `micros` (ascending) that fits, given that micros[0]
    fits: a bisection over the fits / does-not-fit boundary."""
    lo, hi = 0, len(micros) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ev.fails(with_micro(s, micros[mid])):
            hi = mid - 1
        else:
            lo = mid
    return lo


def _partial_checkpointing(ev: _Evaluator, s: TrainingPlan, micros, lo: int, full: TrainingPlan, *,
                           guess: int = 0):
    """Chen et al. 2016 (memkit/plan/techniques.py): at each micro-batch where full checkpointing
    fits, the number of checkpointed blocks K a bisection finds (the smallest that fits where
    memory falls as K grows; it does not always: tests/unit/test_planner_pruning.py), and the
    fastest of those plans. Micro-batches whose no-recompute time cannot beat the best found are
    skipped. Returns (plan, micro index).

    The answer is the one a plain visit gives: micro-batches in order of their no-recompute step
    time, each bisected over K, a plan replacing the best only when strictly faster, the visit
    ending at the first micro-batch whose no-recompute step is not faster than the best. Fewer
    memory estimates reach it, with no assumption about how memory or time vary with K: a
    bisection is cut short once no K it can still end on is faster than the plan to beat (their
    step times are priced directly), since it then cannot change the answer; and micro-batch
    `guess` is bisected first, so there is a fast plan to beat from the start (comment below)."""
    num_blocks = ev.request.model.total_layers
    none = s.with_(checkpointing="none")
    no_recompute = {i: ev.speed_at(none, micros[i]) for i in range(lo + 1)}
    order = sorted(range(lo + 1), key=no_recompute.__getitem__)
    rank = {j: r for r, j in enumerate(order)}  # ties between equal step times go to the earlier

    plans: dict[tuple[int, int], TrainingPlan] = {}  # each derived once: bisection and keys re-read them

    def at(j: int, k: int) -> TrainingPlan:
        hit = plans.get((j, k))
        if hit is None:
            hit = plans[j, k] = _k_plan(s, micros[j], k, num_blocks)
        return hit

    def key(j: int, k: int) -> tuple[float, int]:
        return ev.speed(at(j, k)).step_time_s, rank[j]

    lean = _lean_keys(ev, s, micros, rank)

    def smallest_k(j: int, beat: tuple[float, int]) -> int | None:
        """The bisection's K at micro index j, or None once no K it can end on has a key below `beat`."""
        k_lo, k_hi = 1, num_blocks          # k_hi (= full) fits; find the smallest K that fits
        while k_lo < k_hi:
            if not any(lean(j, k) < beat and key(j, k) < beat for k in range(k_lo, k_hi + 1)):
                return None
            mid = (k_lo + k_hi) // 2
            if ev.fails(at(j, mid)):
                k_lo = mid + 1
            else:
                k_hi = mid
        return k_hi if key(j, k_hi) < beat else None

    best, best_j = full, micros.index(full.micro_batch_size)
    best_key = (ev.speed(full).step_time_s, -1)
    # Speculation: bisect `guess` first; `spec` is its plan's key. If that plan beats full
    # checkpointing and the guess's no-recompute step is faster than it, the plain visit reaches
    # the guess: every micro-batch before it in the order is no slower without recompute than the
    # guess, so faster than spec's step, and the best until then is either slower than spec (no
    # stop) or a key below spec, which is bisected to the end here too. So the visit's answer has
    # a key <= spec, and until one below spec turns up (then the best is known exactly again),
    # bisections are cut short against spec instead of the best, which is not known meanwhile.
    spec_k = smallest_k(guess, best_key)
    spec = key(guess, spec_k) if spec_k is not None and no_recompute[guess] < key(guess, spec_k)[0] else None
    known = spec is None                    # whether best_key is the plain visit's best so far
    for j in order:
        if known and no_recompute[j] >= best_key[0]:
            break
        k = spec_k if j == guess and spec is not None else smallest_k(j, best_key if known else spec)
        if k is not None and (not known or key(j, k) < best_key):  # unknown: k's key is <= spec
            best, best_j, best_key, known = at(j, k), j, key(j, k), True
    return best, best_j


def _k_plan(s: TrainingPlan, micro: int, k: int, num_blocks: int) -> TrainingPlan:
    """Structure `s` at `micro` with its first k of num_blocks blocks checkpointed (k = all: full)."""
    base = with_micro(s, micro)
    return base if k == num_blocks else base.with_(checkpointing=str(k))


def _lean_keys(ev: _Evaluator, s: TrainingPlan, micros, rank: dict[int, int]):
    """For _partial_checkpointing: a lower bound of key(j, k), free to read: the key of s's lean
    dominator (_dominators: the same plan without activation offload, with overlap_comm on) at the
    same micro-batch and K where its step time is already priced (facts (c) and (d) hold at a
    partial K too: tests/unit/test_planner_assumptions.py), else -inf. A K whose lower bound is not
    below the key to beat cannot beat it, so its own step time is not priced."""
    doms = _dominators_of(ev, s)
    if not doms:
        return lambda j, k: (float("-inf"), 0)
    root, num_blocks, speeds = doms[-1], ev.request.model.total_layers, ev.memo.speeds
    plans: dict[tuple[int, int], TrainingPlan] = {}

    def lean(j: int, k: int) -> tuple[float, int]:
        plan = plans.get((j, k))
        if plan is None:
            plan = plans[j, k] = _k_plan(root, micros[j], k, num_blocks)
        hit = speeds.get(plan)
        return (float("-inf"), 0) if hit is None else (hit.step_time_s, rank[j])
    return lean


def _search_memory(ev: _Evaluator, structs: list[TrainingPlan], tier: Tier):
    pruner = _Pruner(ev, structs)
    found: list[Candidate] = []
    rejected: list[Rejection] = []
    for s in structs:
        speed = ev.speed(s)
        known = pruner.known_miss(s, speed.step_time_s)
        if known is not None:
            rejected.append(known)
            continue
        v = ev.check(s)
        if v.reason:
            rej = _rejection(s, v, speed.step_time_s)
            pruner.record(s, v, rej)
            rejected.append(rej)
        else:
            found.append(Candidate(plan=s, memory=v.estimate, speed=speed, tier=tier.name))
    grain = max(1, int(0.01 * ev.budget))
    found.sort(key=lambda c: (device_peak_bytes(c.memory) // grain, c.speed.step_time_s))
    rejected.sort(key=lambda r: (r.overshoot, r.step_time_s))
    return found, rejected


def _rejection(plan: TrainingPlan, v: _Verdict, bound: float) -> Rejection:
    est = v.estimate
    return Rejection(plan=plan, reason=v.reason, overshoot=v.overshoot, step_time_s=bound,
                     device_peak_bytes=device_peak_bytes(est) if est else 0,
                     host_bytes_per_node=est.host_bytes_per_node if est else 0)


def _exact(ev: _Evaluator, r: Rejection) -> Rejection:
    """The rejection with its own estimate (pruned ones carry a sibling's, floored ones their floor's)."""
    if r.exact and not r.floored:
        return r
    return _rejection(r.plan, ev.check(r.plan), r.step_time_s)


def _shape_key(plan: TrainingPlan) -> tuple:
    return (plan.zero_stage, plan.offload_optimizer, plan.offload_params, plan.precision, plan.optimizer,
            plan.checkpointing, plan.tp, plan.pp)


def _distinct_rejections(ev: _Evaluator, rejected: list[Rejection], limit: int) -> list[Rejection]:
    """The first `limit` rejections with distinct shapes, each with its own exact estimate."""
    seen = set()
    out = []
    for r in rejected:
        key = _shape_key(r.plan)
        if key in seen:
            continue
        seen.add(key)
        out.append(_exact(ev, r))
        if len(out) == limit:
            break
    return out


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
    for r in _by_overshoot(ev, [r for r in rejected if r.exact]):
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
            what += f"; it needs {' and '.join(best.needs)}"
    elif rejected:
        first = _exact(ev, rejected[0]) if rejected[0].floored else rejected[0]
        what += f"; e.g. {first.label}: {first.reason}"
    else:  # not one plan shape honours the pins: a request that cannot be met as pinned (exit 2)
        pinned = sorted({flag for flag, _, _ in pins(request)})
        raise MemkitError(f"no plan shape honours the pins ({', '.join(pinned) or 'none'}) with global batch "
                          f"{request.global_batch_size} on {hw.num_gpus} x {hw.gpu.name}; drop a pin or change "
                          "--global-batch-size")
    pinned = sorted({flag for flag, _, _ in pins(request)})
    if pinned:  # every plan estimated honoured them
        what += f"; pinned: {', '.join(pinned)}"
    return NoPlanFits(what, tuple(misses))


def _by_overshoot(ev: _Evaluator, rejected: list[Rejection]):
    """`rejected` sorted by (overshoot, step time), stably, as a generator, each with its exact
    verdict: a floored rejection's overshoot is a lower bound of its exact one, so it is estimated
    (_exact) only when it comes first, and a consumer that stops early skips the rest."""
    heap = [(r.overshoot, r.step_time_s, i, r) for i, r in enumerate(rejected)]
    heapq.heapify(heap)
    while heap:
        _, _, i, r = heapq.heappop(heap)
        if r.floored:
            r = _exact(ev, r)
            heapq.heappush(heap, (r.overshoot, r.step_time_s, i, r))
        else:
            yield r


def _needs(request: Request, ev: _Evaluator, miss: Rejection) -> tuple[str, ...]:
    """What would make `miss` fit, all of it needed: device memory (a bigger GPU, or more GPUs
    for ZeRO to shard over), host RAM."""
    hw = request.hardware
    needs = []
    if miss.device_peak_bytes > ev.budget:
        options = [f"a GPU with >= {_fitting_gpu_gib(request, ev, miss)} GiB"]
        if miss.plan.zero_stage >= 1:
            for factor in (2, 4, 8, 16, 32, 64):
                total = hw.num_gpus * factor
                per_node = min(max(hw.num_gpus_per_node, 8), total)
                bigger = replace(hw, num_gpus_per_node=per_node, num_nodes=total // per_node)
                plan = miss.plan.with_(dp=miss.plan.dp * factor, micro_batch_size=1, grad_accum=1)
                try:
                    est = ev.estimator(request.model, plan, bigger)
                except MemkitError:
                    break
                if device_peak_bytes(est) <= ev.budget:
                    options.append(f"{total} x {hw.gpu.name}")
                    break
        if miss.plan.micro_batch_size == 1:  # the micro-batch cannot shrink; the sequence can
            seq = miss.plan.seq_len // 2
            while seq >= 128:
                try:
                    est = ev.estimator(request.model, miss.plan.with_(seq_len=seq), hw)
                except MemkitError:
                    break
                if device_peak_bytes(est) <= ev.budget:
                    options.append(f"--seq-len {seq}")
                    break
                seq //= 2
        needs.append("(" + " or ".join(options) + ")" if len(options) > 1 else options[0])
    if miss.host_bytes_per_node > hw.host_ram_bytes_per_node:
        needs.append(f">= {_fitting_host_gib(request, ev, miss)} GiB host RAM per node (--host-ram)")
    return tuple(needs)


def _fitting_gpu_gib(request: Request, ev: _Evaluator, miss: Rejection) -> int:
    """Whole GiB of device memory at which `miss` fits, rounded UP and checked by re-estimating on
    a GPU of that size (the estimate itself depends on the device: CUDA context, allocator)."""
    import math

    from memkit.spec.hardware import custom_gpu

    hw = request.hardware
    size = math.ceil(miss.device_peak_bytes / (1.0 - request.headroom) / GIB)
    for _ in range(8):
        bigger = replace(hw, gpu=custom_gpu(size * GIB, like=hw.gpu))
        try:
            peak = device_peak_bytes(ev.estimator(request.model, miss.plan, bigger))
        except MemkitError:
            return size
        if peak <= int((1.0 - request.headroom) * size * GIB):
            return size
        size = max(size + 1, math.ceil(peak / (1.0 - request.headroom) / GIB))
    return size


def _fitting_host_gib(request: Request, ev: _Evaluator, miss: Rejection) -> int:
    """Whole GiB of host RAM per node at which `miss`'s host side fits, rounded UP and re-estimated."""
    import math

    size = math.ceil(miss.host_bytes_per_node / GIB)
    for _ in range(8):
        roomier = replace(request.hardware, host_ram_bytes_per_node=size * GIB)
        try:
            host = ev.estimator(request.model, miss.plan, roomier).host_bytes_per_node
        except MemkitError:
            return size
        if host <= size * GIB:
            return size
        size = max(size + 1, math.ceil(host / GIB))
    return size
