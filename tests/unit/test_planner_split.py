"""Model splits in the planner and the runner's plan checks: tp/pp are offered only as the runner
runs them (memkit.plan.parallel.validate_parallel), chosen when and only when nothing fits
without them or the step-time model says they are faster by more than its stated uncertainty
(never for batch arithmetic), explained in one line; bad split requests are one line, exit 2."""
from __future__ import annotations

import json

import pytest

from memkit.cli.main import main
from memkit.errors import MemkitError
from memkit.plan.plan import TrainingPlan
from memkit.planner import NoPlanFits, Request, search
from memkit.planner.space import layouts, micro_batch_options, structures, tiers
from memkit.spec.hardware import Hardware, custom_gpu, find_gpu
from memkit.spec.hf import load_model_spec, spec_from_config
from memkit.train.config import check_split, knobs_from_deepspeed, resolve_plan
from memkit.plan.parallel import PP_MODEL_TYPES, TP_MODEL_TYPES, validate_parallel
from memkit.units import GIB


def request(model: str, gpu, n: int, batch: int, seq: int, **kw) -> Request:
    gpu = find_gpu(gpu) if isinstance(gpu, str) else gpu
    return Request(model=load_model_spec(model), hardware=Hardware(gpu=gpu, num_gpus_per_node=n),
                   global_batch_size=batch, seq_len=seq, **kw)


def tight() -> Request:
    """llama-3.2-1b, ZeRO-0 pinned, no offload, 2 x 14 GiB: a data-parallel replica needs 14.9 GiB
    at its leanest (estimate) with the standard loss, a 2-way tensor or pipeline split ~10 GiB. (The
    chunked loss makes a replica fit: pinned off so that only a split fits.)"""
    return request("llama-3.2-1b", custom_gpu(14 * GIB), 2, 16, 2048, zero_stage=0, allow_offload=False,
                   loss="standard")


# ---- when a split is chosen ---------------------------------------------------------------------

def test_default_split_mode_lets_splits_compete():
    # Issue #5: split when the model does not fit otherwise OR the step-time model says it is faster.
    assert tight().split == "auto"


def test_if_needed_splits_only_when_nothing_fits_otherwise():
    with pytest.raises(NoPlanFits):
        search(Request(**{**_fields(tight()), "tp": 1, "pp": 1}))
    result = search(Request(**{**_fields(tight()), "split": "if-needed"}))
    plan = result.chosen.plan
    assert (plan.tp, plan.pp) in ((2, 1), (1, 2)) and plan.dp == 1
    assert result.split_reason.startswith(("tensor parallel 2 (DeepSpeed AutoTP): does not fit otherwise "
                                           "(nearest data-parallel plan ZeRO-0 ",
                                           "pipeline parallel 2 (torch.distributed.pipelining, 1F1B): does not "
                                           "fit otherwise (nearest data-parallel plan ZeRO-0 "))
    assert "GiB budget)" in result.split_reason


def test_if_needed_keeps_data_parallel_and_auto_keeps_it_within_the_model_uncertainty():
    # 4 x A100-80GB, llama-3.1-8b, 8 x 4k tokens: the step-time model prices tp=2 within its
    # measured uncertainty of the best data-parallel plan (issue #10), so auto keeps the lower-risk
    # data-parallel plan, and says why when the split was priced faster.
    from memkit.estimate.throughput import step_time_ranking_uncertainty
    default = search(request("llama-3.1-8b", "a100-80gb", 4, 8, 4096, split="if-needed"))
    assert (default.chosen.plan.tp, default.chosen.plan.pp) == (1, 1) and default.split_reason == ""
    auto = search(request("llama-3.1-8b", "a100-80gb", 4, 8, 4096, split="auto"))
    assert (auto.chosen.plan.tp, auto.chosen.plan.pp) == (1, 1) and auto.split_reason == ""
    note = [n for n in auto.notes if n.startswith("kept ")]
    tp2 = search(request("llama-3.1-8b", "a100-80gb", 4, 8, 4096, tp=2)).chosen.speed.step_time_s
    if tp2 < auto.chosen.speed.step_time_s:   # the split is priced faster, within the uncertainty
        assert len(note) == 1 and "tp2" in note[0] and "lower risk (no model split)" in note[0]
    else:   # the data-parallel plan is priced faster outright: nothing to explain
        assert note == []
    split = [a for a in auto.alternatives if a.plan.tp == 2]
    if split:  # when the split is among the alternatives shown, its gain is within the uncertainty
        assert auto.chosen.speed.step_time_s <= split[0].speed.step_time_s * (1 + step_time_ranking_uncertainty())


def test_auto_keeps_data_parallel_when_no_split_is_faster():
    result = search(request("llama-3.2-1b", "a100-80gb", 2, 16, 2048, split="auto"))
    assert (result.chosen.plan.tp, result.chosen.plan.pp) == (1, 1) and result.split_reason == ""


def test_pinned_split_says_so():
    result = search(request("llama-3.2-1b", "a100-80gb", 2, 16, 2048, pp=2))
    assert result.chosen.plan.pp == 2
    assert result.split_reason == "pipeline parallel 2 (torch.distributed.pipelining, 1F1B): pinned by --pp 2"


@pytest.mark.parametrize("split", ["if-needed", "auto"])
def test_no_split_mode_splits_to_fix_the_batch_arithmetic(split):
    with pytest.raises(MemkitError, match=r"--global-batch-size 4 cannot be met exactly: .*\(8\).*; or split the "
                                          r"model on purpose with --tp N / --pp N \(data-parallel degrees 1, 2, 4\)"):
        search(request("llama-3.2-1b", "a100-80gb", 8, 4, 1024, split=split))


# ---- what is offered: only what the runner runs ----------------------------------------------------

@pytest.mark.parametrize("model, tps, pps", [
    ("llama-3.2-1b", {1, 2, 4, 8}, {1, 2, 4, 8}),
    ("phi-3-mini", {1}, {1, 2, 4, 8}),  # fused qkv: not proven under AutoTP
    ("gpt2", {1}, {1}),
    ("bert-base-uncased", {1}, {1}),
    ("t5-small", {1}, {1}),
])
def test_split_degrees_follow_the_runner_families(model, tps, pps):
    lays = layouts(request(model, "a100-80gb", 8, 256, 512, split="auto"))
    assert {t for t, _, _ in lays} == tps and {p for _, p, _ in lays} == pps
    assert all(t == 1 or p == 1 for t, p, _ in lays)  # never tp and pp together
    assert all(t * p * dp == 8 for t, p, dp in lays)
    assert set(TP_MODEL_TYPES) <= set(PP_MODEL_TYPES)


def test_tp_divides_heads_kv_heads_and_mlp_within_a_node():
    spec = spec_from_config({"model_type": "llama", "hidden_size": 96, "intermediate_size": 200,
                             "num_hidden_layers": 4, "num_attention_heads": 12, "num_key_value_heads": 4,
                             "vocab_size": 128}, name="odd")
    req = Request(model=spec, hardware=Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=4, num_nodes=2),
                  global_batch_size=64, seq_len=128, split="auto")
    # 12 heads, 4 KV heads, MLP 200: tp 2 and 4 divide all three, 8 does not divide the heads and
    # would cross the 4-GPU node anyway.
    assert {t for t, _, _ in layouts(req)} == {1, 2, 4}


def test_every_split_structure_is_runnable():
    req = request("llama-3.2-1b", "a100-40gb", 4, 8, 4096, split="auto")
    seen = set()
    for tier in tiers(req):
        for lay in layouts(req):
            for plan in structures(req, tier, lay):
                if plan.tp > 1:
                    assert (plan.engine, plan.tp_engine) == ("deepspeed", "autotp") and plan.zero_stage <= 2
                    seen.add("tp")
                if plan.pp > 1:
                    assert (plan.engine, plan.pp_engine, plan.pp_schedule, plan.zero_stage) == ("torch", "torch",
                                                                                                "1f1b", 0)
                    assert plan.precision != "fp16"
                    seen.add("pp")
                    for micro in micro_batch_options(req, plan.dp, plan.pp):  # 1F1B: accum >= pp
                        assert (req.global_batch_size // plan.dp) // micro >= plan.pp
                if plan.tp * plan.pp > 1:
                    assert plan.offload_optimizer == plan.offload_params == "none"
                    validate_parallel(req.model, plan, req.hardware)
    assert seen == {"tp", "pp"}


# ---- bad split requests: one line, exit 2 ---------------------------------------------------------

@pytest.mark.parametrize("model, pins, message", [
    ("gpt2", ["--tp", "2"], "tp=2 on model_type 'gpt2': the runner's tensor parallel (DeepSpeed AutoTP) is "
                            "proven on llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text; use tp=1"),
    ("bert-base-uncased", ["--tp", "2"], "tp=2 on bert-base-uncased (encoder, bert): memkit splits decoder-only "
                                         "causal LMs only"),
    ("t5-small", ["--pp", "2"], "pp=2 on t5-small (encoder-decoder, t5): memkit splits decoder-only"),
    ("gpt2", ["--pp", "2"], "pp=2 on model_type 'gpt2': the runner splits llama"),
    ("gpt2", ["--tp", "2", "--pp", "2"], "tp=2 x pp=2 on model_type 'gpt2': the runner tensor-splits llama"),
    ("llama-3.2-1b", ["--pp", "2", "--zero", "1"], "pp=2 with --zero 1: the runner's pipeline path"),
    ("llama-3.2-1b", ["--tp", "2", "--offload-optimizer", "cpu"], "tp=2 with offload: memkit runs DeepSpeed "
                                                                  "AutoTP without ZeRO offload"),
    ("llama-3.2-1b", ["--pp", "4", "--global-batch-size", "2"], "--pp 4 with --global-batch-size 2: the 1F1B "
                                                                "pipeline needs at least 4 micro-batches"),
])
def test_suggest_refuses_splits_the_runner_cannot_run(model, pins, message, capsys):
    batch = [] if "--global-batch-size" in pins else ["--global-batch-size", "16"]
    code = main(["suggest", "--model", model, "--gpu", "a100-80gb", "--num-gpus", "4", "--seq-len", "128",
                 *batch, *pins])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"memkit: error: {message}"), err


# ---- the runner's plan checks ---------------------------------------------------------------------

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 256}
PP2 = TrainingPlan(engine="torch", precision="fp32", pp=2, dp=1, grad_accum=4, seq_len=64)
TP2 = TrainingPlan(engine="deepspeed", precision="fp32", tp=2, dp=1, grad_accum=4, seq_len=64)


def test_split_plans_keep_their_degrees_and_must_fill_the_world():
    assert resolve_plan(plan=PP2, flags={}, ds_config=None, world_size=2, distributed_type="MULTI_CPU") == PP2
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 0},
          "tensor_parallel": {"autotp_size": 2}}
    assert knobs_from_deepspeed(ds)["tp"] == 2
    assert resolve_plan(plan=TP2, flags={}, ds_config=ds, world_size=2, distributed_type="DEEPSPEED") == TP2
    with pytest.raises(MemkitError, match=r"disagree \(tp: plan 2 vs file 1\)"):
        resolve_plan(plan=TP2, flags={}, ds_config={**ds, "tensor_parallel": {}}, world_size=2,
                     distributed_type="DEEPSPEED")
    with pytest.raises(MemkitError, match=r"dp\*tp\*pp = 1\*1\*2 = 2 processes but 4 were launched"):
        resolve_plan(plan=PP2, flags={}, ds_config=None, world_size=4, distributed_type="MULTI_CPU")
    with pytest.raises(MemkitError, match=r"pp=2, which runs through torch.distributed.pipelining, but this run "
                                          r"is under DeepSpeed"):
        resolve_plan(plan=PP2, flags={}, ds_config={"zero_optimization": {"stage": 0}}, world_size=2,
                     distributed_type="DEEPSPEED")
    with pytest.raises(MemkitError, match=r"tp=2 \(DeepSpeed AutoTP\) but this run is not under DeepSpeed"):
        resolve_plan(plan=TP2, flags={}, ds_config=None, world_size=2, distributed_type="MULTI_CPU")


@pytest.mark.parametrize("config, plan, kw, message", [
    ({"model_type": "gpt2", "n_embd": 64, "n_layer": 4, "n_head": 4, "vocab_size": 100, "n_positions": 128},
     TP2, {}, r"tp=2 on model_type 'gpt2'"),
    (TINY, PP2, {"env": {"WORLD_SIZE": "4", "RANK": "0"}}, r"dp\*pp\*tp = 1\*2\*1 = 2 but 4 processes were launched"),
    (TINY, TP2, {"env": {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "1"}},
     r"tp=2 but 1 processes per node were launched"),
])
def test_runner_startup_checks(tmp_path, config, plan, kw, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    args = {"env": {"WORLD_SIZE": "2", "RANK": "0"}, **kw}
    doc = {"hardware": {"gpu": "a100-80gb", "num_gpus_per_node": 2, "num_nodes": 1}}
    with pytest.raises(MemkitError, match=message) as info:
        check_split(plan, doc, config_path=path, model_name="m", **args)
    assert info.value.exit_code == 2 and "\n" not in str(info.value)
    if "env" in kw:  # before the launch (`memkit train`) only the plan and the model are checked
        check_split(plan, doc, config_path=path, model_name="m", env=None)


def _fields(req: Request) -> dict:
    return {name: getattr(req, name) for name in Request.__dataclass_fields__}
