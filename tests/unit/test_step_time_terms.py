"""Hand-worked checks of the step-time terms added in session 3 (memkit/estimate/throughput.py,
kernels.py): the multi-node ring over all of a node's NICs, the Hopper sustained clock,
torch 1.x's per-parameter optimizer loop, and GEMM tiles in waves of one per SM with split-K."""
from __future__ import annotations

import pytest

from memkit.estimate import kernels
from memkit.estimate import throughput as tp_model
from memkit.estimate.throughput import estimate_step_time
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec
from memkit.spec.stack import Stack

LLAMA1B = load_model_spec("llama-3.2-1b")
A100 = find_gpu("a100-80gb")
H100 = find_gpu("h100-80gb")


def test_a_ring_across_nodes_runs_over_every_nic_its_ranks_hold_on_a_node():
    two_nodes = Hardware(gpu=A100, num_gpus_per_node=8, num_nodes=2, inter_node_gbps=25.0)
    # dp=16: 8 ranks of the ring per node -> 8 NICs x 25 GB/s = 200 GB/s, below NVLink's 230
    link = tp_model._dp_link(TrainingPlan(dp=16), two_nodes)
    assert (link.gbps, link.kind) == (200.0, "net")
    # tp=4 x dp=4: each DP ring has 8 // 4 = 2 ranks per node, so 2 NICs
    assert tp_model._dp_link(TrainingPlan(dp=4, tp=4), two_nodes).gbps == 50.0
    # a fast network is capped by the intra-node hops of the same ring
    fat = Hardware(gpu=A100, num_gpus_per_node=8, num_nodes=2, inter_node_gbps=50.0)
    assert tp_model._dp_link(TrainingPlan(dp=16), fat).gbps == 230.0
    # one node: NVLink, as before
    assert tp_model._dp_link(TrainingPlan(dp=8), Hardware(gpu=A100, num_gpus_per_node=8)).kind == "nvlink"


def test_deepspeed_stage0_allreduce_across_two_nodes_by_hand():
    hw = Hardware(gpu=A100, num_gpus_per_node=8, num_nodes=2, inter_node_gbps=25.0)
    plan = TrainingPlan(zero_stage=0, engine="deepspeed", dp=16, micro_batch_size=4, seq_len=1024)
    est = estimate_step_time(LLAMA1B, plan, hw)
    grads = LLAMA1B.num_params * 2                       # 16-bit grads under DeepSpeed bf16
    buckets = LLAMA1B.num_params / plan.reduce_bucket_size
    # ring all-reduce: 2 (n-1)/n of the buffer at 8 x 25 GB/s, + NCCL's latency per bucket
    # (8.4 us base + 2 (n-1) hops of 6.6 us over the network)
    expected = grads * 2 * 15 / 16 / 200e9 + buckets * (8.4e-6 + 30 * 6.6e-6)
    assert est.components_s["dp_comm"] == pytest.approx(expected)


def test_hopper_tensor_cores_run_at_the_power_limited_clock():
    # 8192^3 bf16 on H100 SXM: MAMF share of 989.5 TFLOP/s (80.1 %) at 1575 of 1980 MHz; its
    # 32 x 64 = 2048 tiles of 256x128 run in 16 waves of 132 SMs (2112 slots)
    t = kernels.gemm_time_s(H100, "bf16", 8192, 8192, 8192)
    assert t == pytest.approx(2 * 8192**3 / (989.5e12 * 0.801 * 1575 / 1980) * 2112 / 2048)
    counted = 4.0 * 8192 * 4096 * 32 * 128
    assert kernels.flash_attention_time_s(H100, "bf16", counted) == pytest.approx(
        counted / (989.5e12 * 0.35 * 1575 / 1980))


def test_torch_1x_steps_adamw_one_parameter_at_a_time():
    one = Hardware(gpu=A100)
    plan = TrainingPlan(engine="torch", micro_batch_size=1, seq_len=512)
    new = estimate_step_time(LLAMA1B, plan, one, stack=Stack(torch="2.3")).components_s["optimizer_step"]
    old = estimate_step_time(LLAMA1B, plan, one, stack=Stack(torch="1.10")).components_s["optimizer_step"]
    assert new == estimate_step_time(LLAMA1B, plan, one).components_s["optimizer_step"]
    # torch >= 2.0: the foreach AdamW, 20 fp32 passes (torch/optim/adam.py _multi_tensor_adam), no
    # 16-bit copy under AMP; then clip_grad_norm_'s norm read and rescale read + write, 3 fp32 passes
    clip = kernels.memory_time_s(A100, LLAMA1B.num_params * 3 * 4)
    assert new == pytest.approx(kernels.memory_time_s(A100, LLAMA1B.num_params * 20 * 4) + clip)
    # 9 fp32 passes of 92 B per parameter, or 9 launches per tensor (16 blocks x 9 + 3), whichever is longer
    tensors = 16 * 9 + 3
    assert old == pytest.approx(max(kernels.memory_time_s(A100, LLAMA1B.num_params * 92),
                                    tensors * 9 * tp_model.OP_DISPATCH_S) + clip)
    assert old > new
    # DeepSpeed steps its flat partitions with its own fused Adam whatever torch is installed
    ds = plan.with_(engine="deepspeed", zero_stage=1)
    assert (estimate_step_time(LLAMA1B, ds, one, stack=Stack(torch="1.10")).components_s["optimizer_step"]
            == estimate_step_time(LLAMA1B, ds, one).components_s["optimizer_step"])


def test_torch_amp_dispatches_a_cast_per_fp32_weight_and_norm_fed_input():
    bert = load_model_spec("bert-large-uncased")
    v100 = find_gpu("v100-16gb")
    by_role = {lin.role: lin for lin in bert.layer_linears}
    amp = TrainingPlan(precision="fp16", engine="torch", micro_batch_size=1, seq_len=512)
    ops = {r: tp_model._linear_pass(v100, amp, bert, by_role[r], 512).num_ops for r in ("q", "o")}
    # addmm/mm/mm (3) + weight and bias cast forward + their ToCopyBackward (4) + the fp32
    # LayerNorm output cast for q (2); o's input is already fp16
    assert ops == {"q": 3 + 4 + 2, "o": 3 + 4}
    # DeepSpeed's fp16 engine holds 16-bit weights: no casts
    ds = amp.with_(engine="deepspeed", zero_stage=2)
    assert tp_model._linear_pass(v100, ds, bert, by_role["q"], 512).num_ops == 3


def test_an_overlapped_collective_costs_the_compute_the_measured_share_of_its_time():
    # NVIDIA/nccl #1428 (A100-SXM4-80GB, AllGather overlapping a GEMM): 1.18 ms alone, 2.08 ms
    # overlapped, so the compute loses 1 - 1.18/2.08 = 0.4327 of the time the collective runs.
    assert tp_model.OVERLAP_COMPUTE_COST == pytest.approx(0.4327, abs=1e-4)
    # 0.1 s of all-gather under a 1 s compute window: nothing sticks out, 0.0433 s lost
    assert tp_model._overlapped(0.1, 1.0) == pytest.approx(0.04327, abs=1e-5)
    # 2 s under a 1 s window: 1 s sticks out, plus 0.4327 s lost during the overlapped second
    assert tp_model._overlapped(2.0, 1.0) == pytest.approx(1.4327, abs=1e-4)
    assert tp_model._overlapped(0.5, 0.0) == 0.5


def test_ranked_pairs_orders_each_pair_within_a_group_by_hand():
    from memkit.calibrate.published_throughput import ThroughputCase, ThroughputOutcome, rank_agreement, ranked_pairs

    def row(name, group, measured, predicted):
        case = ThroughputCase(case_id=name, source_id="s", group=group, measured_tps_per_gpu=measured,
                              absolute=True, summary="")
        return ThroughputOutcome(case=case, predicted_tps_per_gpu=predicted)
    rows = [row("a", "g", 100, 100), row("b", "g", 110, 130), row("c", "g", 120, 120),
            row("d", "g", 120, 100), row("x", "other", 1, 1e6)]
    kinds = {(a.case.case_id, b.case.case_id): k for a, b, k in ranked_pairs(rows)}
    # a<b, a<c ordered as measured; b>c predicted against c>b measured; a,d tied in prediction;
    # b,d discordant; c,d measured equal -> not a pair; x is alone in its group
    assert kinds == {("a", "b"): "concordant", ("a", "c"): "concordant", ("a", "d"): "tied",
                     ("b", "c"): "discordant", ("b", "d"): "discordant"}
    assert rank_agreement(rows) == (2, 2, 1)


def test_fsdp_reducing_in_fp32_moves_twice_the_gradient_bytes_by_hand():
    # FSDP (torch engine, ZeRO-3) on one A100 node, dp=8, nothing to hide under (zero windows):
    # exposed = forward gather + (backward gather + reduce-scatter) + the two unprefetched gathers
    hw = Hardware(gpu=A100, num_gpus_per_node=8)
    plan = TrainingPlan(dp=8, zero_stage=3, engine="torch", precision="bf16")
    n, layers, ring = LLAMA1B.num_params, LLAMA1B.total_layers, 230e9
    latency = layers * (tp_model.NCCL_BASE_LATENCY_S + 7 * tp_model.NCCL_HOP_LATENCY_S["nvlink"])
    ag = 7 / 8 * 2 * n / ring + latency                      # bf16 params gathered
    rs_bf16 = 7 / 8 * 2 * n / ring + latency
    rs_fp32 = 7 / 8 * 4 * n / ring + latency                 # reduce_dtype=float32
    by_hand = lambda rs: ag + (ag + rs) + 2 * ag / layers    # noqa: E731
    assert tp_model._dp_comm(plan, LLAMA1B, hw, 0.0, 0.0).micro_s == pytest.approx(by_hand(rs_bf16))
    assert tp_model._dp_comm(plan, LLAMA1B, hw, 0.0, 0.0, reduce_itemsize=4).micro_s == pytest.approx(
        by_hand(rs_fp32))


def test_checkpoint_recompute_stops_before_the_down_projection_from_torch_2_1():
    # Non-reentrant checkpoint with early stop (torch >= 2.1) stops once the last saved tensor --
    # the down projection's input -- is recomputed; its matmul is never re-run. By hand, per block:
    # one GEMM of tokens x hidden x intermediate, at the kernel model's rate.
    hw = Hardware(gpu=A100, num_gpus_per_node=1)
    plan = TrainingPlan(micro_batch_size=4, seq_len=2048, checkpointing="full")
    tokens, h, i = 4 * 2048, LLAMA1B.hidden_size, LLAMA1B.intermediate_size
    down = kernels.gemm_time_s(A100, plan.precision, tokens, h, i)
    new = estimate_step_time(LLAMA1B, plan, hw).components_s["recompute"]
    old = estimate_step_time(LLAMA1B, plan, hw, stack=Stack(torch="2.0")).components_s["recompute"]
    assert old - new == pytest.approx(LLAMA1B.num_layers * down, rel=1e-9)
    # nothing to skip where the down projection's output is saved: hidden dropout (GPT-2) draws
    # its mask on it, a post-norm LayerNorm (BERT) saves it
    for name in ("gpt2", "bert-large-uncased"):
        m = load_model_spec(name)
        p = TrainingPlan(micro_batch_size=4, seq_len=512, checkpointing="full")
        assert (estimate_step_time(m, p, hw).components_s["recompute"]
                == estimate_step_time(m, p, hw, stack=Stack(torch="2.0")).components_s["recompute"])


def test_gemm_tiles_run_in_waves_of_one_per_sm_and_split_k_fills_a_short_wave():
    from dataclasses import replace
    assert (A100.num_sms, H100.num_sms) == (108, 132)   # catalog: NVIDIA A100 / H100 whitepapers
    # MPT-13B attention output projection at micro 2 x 2048 on H100: M = 4096, N = 5120 ->
    # 16 x 40 = 640 tiles of 256x128 (32 x 20 the other way round), 5 waves of 132 = 660 slots
    assert kernels.wave_quantization(H100, 4096, 5120, 5120) == (pytest.approx(640 / 660), 1)
    # its weight gradient in a 125M model: 768 x 768 from K = 65536 tokens is only 3 x 6 = 18 tiles,
    # so K is split 108 // 18 = 6 ways to fill one wave of 108 A100 SMs
    assert kernels.wave_quantization(A100, 768, 768, 65536) == (pytest.approx(1.0), 6)
    t = kernels.gemm_time_s(A100, "bf16", 768, 768, 65536)
    math_s = 2 * 768 * 768 * 65536 / (312e12 * 0.859 * 1305 / 1410)
    reduce_s = (8 * 6 + 2) * 768 * 768 / (2039e9 * 0.85)   # 6 fp32 partials written + read, C written
    assert t == pytest.approx(math_s + reduce_s)
    # K too short to split: one K stage of 64 per slice at most (K = 128 -> 2 slices)
    assert kernels.wave_quantization(A100, 768, 768, 128) == (pytest.approx(18 * 2 / 108), 2)
    # a GPU of unknown SM count keeps tile quantization alone: N = 1000 pads to 1024
    unknown = replace(A100, num_sms=0)
    assert kernels.wave_quantization(unknown, 4096, 1000, 4096) == (pytest.approx(1000 / 1024), 1)
