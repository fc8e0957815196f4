"""Hand-worked checks of the step-time terms added in session 4 (memkit/estimate/kernels.py,
throughput.py): flash attention's rate by sequence length and head dim (FlashAttention-2's
Figure 4), its forward/backward split by the kernel's own FLOPs, FSDP's BACKWARD_POST prefetch,
and eager vs fused RMSNorm traffic."""
from __future__ import annotations

import pytest

from memkit.estimate import kernels
from memkit.estimate import throughput as tp_model
from memkit.estimate.throughput import estimate_step_time
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec

LLAMA1B = load_model_spec("llama-3.2-1b")
GPT2 = load_model_spec("gpt2")
A100 = find_gpu("a100-80gb")
H100 = find_gpu("h100-80gb")


def test_flash_rate_follows_the_paper_figure_relative_to_its_16k_plateau():
    # A100, causal, head dim 128: 155 TFLOP/s at 2k against 189 at 16k (figure bars)
    assert kernels.flash_attention_length_factor(A100, 2048, 128, True) == pytest.approx(155 / 189)
    # H100, causal, head dim 64 at 512: 141 of 284
    assert kernels.flash_attention_length_factor(H100, 512, 64, True) == pytest.approx(141 / 284)
    # head dim 96 halfway between the 64 and 128 curves; 3k halfway (in log2) between 2k and 4k
    half = (155 / 189 + 140 / 171) / 2
    assert kernels.flash_attention_length_factor(A100, 2048, 96, True) == pytest.approx(half)
    between = (155 + (173 - 155) * 0.5849625007211562) / 189      # log2(3072 / 2048)
    assert kernels.flash_attention_length_factor(A100, 3072, 128, True) == pytest.approx(between)
    # beyond 16k and below 512 the ends hold; a bar hidden under the legend interpolates
    assert kernels.flash_attention_length_factor(A100, 65536, 128, True) == 1.0
    assert kernels.flash_attention_length_factor(A100, 128, 128, True) == pytest.approx(99 / 189)
    assert kernels.flash_attention_length_factor(A100, 1024, 64, False) == pytest.approx((132 + 162) / 2 / 176)
    # the time at 16k is the paper's headline utilisation, unchanged
    counted = 4.0 * 16384 * 16384 * 32 * 128
    assert kernels.flash_attention_time_s(A100, "bf16", counted) == pytest.approx(
        counted / (312e12 * 0.50 * 1305 / 1410))
    assert kernels.flash_attention_time_s(A100, "bf16", counted, seq_len=2048) == pytest.approx(
        counted / (312e12 * 0.50 * 1305 / 1410 * 155 / 189))


def test_shorter_sequences_never_run_flash_faster():
    for gpu in (A100, H100):
        for causal in (True, False):
            for d in (64, 80, 128):
                f = [kernels.flash_attention_length_factor(gpu, s, d, causal) for s in (256, 512, 1024, 2048, 4096,
                                                                                       8192, 16384, 32768)]
                assert f == sorted(f)


def test_flash_forward_is_one_part_in_three_and_a_half_of_its_pass():
    plan = TrainingPlan(micro_batch_size=2, seq_len=4096, precision="bf16", attention="flash")
    p = tp_model._attention_pass(A100, plan, LLAMA1B, plan.micro_batch_size * plan.seq_len)
    assert p.bwd_s == pytest.approx(2.5 * p.fwd_s)
    heads, q = LLAMA1B.num_attention_heads, LLAMA1B.head_dim
    counted = 4.0 * 8192 * 4096 * heads * q
    both = kernels.flash_attention_time_s(A100, "bf16", 3 * counted, seq_len=4096, head_dim=q, causal=True)
    assert p.fwd_s + p.bwd_s == pytest.approx(both)


def test_backward_post_exposes_the_backward_gathers():
    hw = Hardware(gpu=H100, num_gpus_per_node=8)
    plan = TrainingPlan(engine="torch", zero_stage=3, dp=8, micro_batch_size=2, seq_len=2048, precision="bf16",
                        attention="flash")
    pre = estimate_step_time(LLAMA1B, plan, hw)
    post = estimate_step_time(LLAMA1B, plan, hw, backward_prefetch="post")
    assert pre.components_s["dp_comm"] == estimate_step_time(LLAMA1B, plan, hw).components_s["dp_comm"]
    assert post.step_time_s > pre.step_time_s
    # by hand: forward gathers overlapped, every backward gather exposed, reduce-scatters overlapped
    comm = tp_model._dp_comm(plan, LLAMA1B, hw, 1.0, 1.0, backward_prefetch="post")
    link = tp_model._dp_link(plan, hw)
    layers = LLAMA1B.total_layers
    ag = tp_model._ring_time_s(LLAMA1B.num_params * 2, 8, link, allreduce=False, count=layers)
    rs = tp_model._ring_time_s(LLAMA1B.num_params * 2, 8, link, allreduce=False, count=layers)
    expected = tp_model._overlapped(ag, 1.0) + ag + tp_model._overlapped(rs, 1.0) + ag / layers
    assert comm.micro_s == pytest.approx(expected)
    # DeepSpeed's engine has no such switch; SHARD_GRAD_OP gathers once per forward
    ds = plan.with_(engine="deepspeed")
    assert (estimate_step_time(LLAMA1B, ds, hw, backward_prefetch="post").step_time_s
            == estimate_step_time(LLAMA1B, ds, hw).step_time_s)
    with pytest.raises(ValueError):
        estimate_step_time(LLAMA1B, plan, hw, backward_prefetch="sideways")


def test_eager_rmsnorm_traffic_op_by_op():
    # bf16 input: to(fp32) 2+4, pow 4+4, mean 4, x*rsqrt 4+4, to(bf16) 4+2, weight* 2+2
    assert tp_model.eager_rmsnorm_bytes(2) == 36
    # fp32 input (AMP residual stream): both casts are no-ops
    assert tp_model.eager_rmsnorm_bytes(4) == 28


def test_compile_fuses_rmsnorm_but_not_layernorm():
    plan = TrainingPlan(micro_batch_size=4, seq_len=2048, precision="bf16", attention="flash")
    tokens = plan.micro_batch_size * plan.seq_len
    eager = tp_model._elementwise_pass(A100, plan, LLAMA1B, 1, tokens)
    fused = tp_model._elementwise_pass(A100, plan, LLAMA1B, 1, tokens, compiled=True)
    res = 4 if tp_model._amp_fp32_weights(plan) else 2   # the residual stream's dtype
    assert res == 2                              # DeepSpeed bf16: a 16-bit model
    h = LLAMA1B.hidden_size
    saved = 2 * (tp_model.eager_rmsnorm_bytes(res) - 2 * res) * h * tokens   # two norms per block
    assert eager.fwd_s - fused.fwd_s == pytest.approx(kernels.memory_time_s(A100, saved))
    hw = Hardware(gpu=A100)
    assert (estimate_step_time(LLAMA1B, plan, hw, compiled=True).step_time_s
            < estimate_step_time(LLAMA1B, plan, hw).step_time_s)
    # GPT-2's LayerNorm is one native kernel either way: compiled, only its gelu_new chain fuses
    # into the one-kernel act(x) (r + w per element)
    g = tp_model._elementwise_pass(A100, plan, GPT2, 1, tokens)
    g_fused = tp_model._elementwise_pass(A100, plan, GPT2, 1, tokens, compiled=True)
    e = tp_model._elt(plan)
    autocast = tp_model.numerics(plan).autocast is not None
    gelu_saved = (tp_model.gelu_new_bytes(e, autocast=autocast) - 2 * e) * GPT2.intermediate_size * tokens
    assert gelu_saved > 0
    assert g.fwd_s - g_fused.fwd_s == pytest.approx(kernels.memory_time_s(A100, gelu_saved))
