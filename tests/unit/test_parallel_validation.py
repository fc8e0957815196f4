"""Tensor/pipeline parallel input checks (one MemkitError line each, exit 2 at the driver), the
rank layout, and the pipeline stage split of every family the runner claims to split: the
stages chained in one process give the whole model's logits exactly."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memkit.errors import MemkitError
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec, spec_from_config
from memkit.plan.parallel import PP_MODEL_TYPES, TP_MODEL_TYPES, rank_layout, stage_layers, validate_parallel
from memkit.train.parallel import autotp_deepspeed_config

REPO = Path(__file__).resolve().parents[2]
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 256,
        "tie_word_embeddings": False}


def hw(num_gpus_per_node: int = 8, num_nodes: int = 1) -> Hardware:
    return Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=num_gpus_per_node, num_nodes=num_nodes)


def tp_plan(tp: int, dp: int = 1, **kw) -> TrainingPlan:
    return TrainingPlan(**{"engine": "deepspeed", "precision": "fp32", "tp": tp, "dp": dp, **kw})


def pp_plan(pp: int, dp: int = 1, **kw) -> TrainingPlan:
    return TrainingPlan(**{"engine": "torch", "precision": "fp32", "pp": pp, "dp": dp, "grad_accum": pp, **kw})


SPEC = spec_from_config(TINY, name="tiny")
SPEC_KV4 = spec_from_config({**TINY, "num_key_value_heads": 4}, name="tiny-mha")


# ---- what the runner accepts ------------------------------------------------------------------

def test_valid_splits_pass():
    validate_parallel(SPEC, tp_plan(2, dp=4), hw(8))
    validate_parallel(SPEC, tp_plan(2, zero_stage=2, dp=4), hw(8))
    validate_parallel(SPEC, pp_plan(2, dp=4), hw(8))
    validate_parallel(SPEC, pp_plan(4, dp=2, pp_schedule="gpipe", grad_accum=1), hw(8))
    validate_parallel(SPEC, pp_plan(2, precision="bf16"), hw(2))
    validate_parallel(load_model_spec("llama-3.1-8b"), tp_plan(8), hw(8))


# ---- bad input: one clear line each ------------------------------------------------------------

@pytest.mark.parametrize("spec_changes, tp, match", [
    ({"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 96}, 4,
     r"tp=4 does not divide num_attention_heads=6, num_key_value_heads=6"),
    ({"num_key_value_heads": 1}, 2, r"tp=2 does not divide num_key_value_heads=1"),
    ({"intermediate_size": 130, "num_key_value_heads": 4}, 4,
     r"tp=4 does not divide intermediate_size=130; try tp in \{1,2\}"),
])
def test_tp_must_divide_heads_kv_heads_and_mlp(spec_changes, tp, match):
    spec = spec_from_config({**TINY, **spec_changes}, name="tiny")
    with pytest.raises(MemkitError, match=match):
        validate_parallel(spec, tp_plan(tp), hw(tp))


def test_tp_across_nodes():
    with pytest.raises(MemkitError, match=r"tp=4 spans nodes \(2 GPUs per node\)"):
        validate_parallel(SPEC_KV4, tp_plan(4), hw(2, num_nodes=2))


def test_tp_groups_must_not_straddle_nodes():
    with pytest.raises(MemkitError, match=r"tp=4 does not divide 6 GPUs per node"):
        validate_parallel(SPEC_KV4, tp_plan(4, dp=3), hw(6, num_nodes=2))


def test_pp_more_than_layers():
    with pytest.raises(MemkitError, match=r"pp=8 exceeds the model's 4 layers; use pp <= 4"):
        validate_parallel(SPEC, pp_plan(8), hw(8))


def test_degrees_must_fill_the_gpus():
    with pytest.raises(MemkitError, match=r"dp\*tp\*pp = 1\*2\*1 = 2 but the hardware has 4 GPUs"):
        validate_parallel(SPEC, tp_plan(2), hw(4))


@pytest.mark.parametrize("model, what, match", [
    ("bert-base-uncased", "tp", r"tp=2 on bert-base-uncased \(encoder, bert\): memkit splits decoder-only"),
    ("t5-small", "pp", r"pp=2 on t5-small \(encoder-decoder, t5\): memkit splits decoder-only"),
    ("gpt2", "tp", r"tp=2 on model_type 'gpt2'.*proven on llama"),
    ("gpt2", "pp", r"pp=2 on model_type 'gpt2': the runner splits llama"),
])
def test_architectures_the_runner_cannot_split(model, what, match):
    spec = load_model_spec(model)
    plan = tp_plan(2, seq_len=512) if what == "tp" else pp_plan(2, seq_len=512)
    with pytest.raises(MemkitError, match=match):
        validate_parallel(spec, plan, hw(2))


@pytest.mark.parametrize("plan, match", [
    (TrainingPlan(engine="deepspeed", precision="fp32", tp=2, pp=2, grad_accum=2),
     r"tp=2 x pp=2 with tp engine 'autotp': inside pipeline stages memkit runs torch tensor parallel"),
    (TrainingPlan(engine="deepspeed", precision="fp32", tp=2, pp=2, grad_accum=2, tp_engine="tp_plan"),
     r"pipeline runs through torch.distributed.pipelining.*use engine 'torch'"),
    (tp_plan(2, tp_engine="tp_plan"), r"tp engine 'tp_plan' is not run by memkit; use tp_engine 'autotp'"),
    (TrainingPlan(engine="torch", precision="fp32", tp=2), r"AutoTP runs inside DeepSpeed; use engine 'deepspeed'"),
    (tp_plan(2, lora_rank=8), r"tp=2 with LoRA"),
    (pp_plan(2, pp_engine="deepspeed"), r"pp engine 'deepspeed' is not run by memkit"),
    (pp_plan(2, engine="deepspeed"), r"pipeline runs through torch.distributed.pipelining.*use engine 'torch'"),
    (pp_plan(2, zero_stage=1), r"pp=2 with --zero 1.*use --zero 0"),
    (pp_plan(2, precision="fp16"), r"pp=2 with --precision fp16.*use bf16 or fp32"),
    (pp_plan(2, lora_rank=8), r"pp=2 with LoRA"),
    (pp_plan(4, grad_accum=2), r"1F1B and --grad-accum 2: 1F1B needs at least pp micro-batches.*--grad-accum >= 4"),
])
def test_plans_the_runner_cannot_run(plan, match):
    with pytest.raises(MemkitError, match=match):
        validate_parallel(SPEC, plan, hw(plan.num_gpus))


def test_tp_times_pp_runs_with_the_engines_split_plan_gives_it():
    from memkit.plan.parallel import split_name, split_plan

    plan = split_plan(TrainingPlan(precision="fp32", tp=2, pp=2, grad_accum=2))
    assert (plan.engine, plan.tp_engine, plan.pp_engine, plan.pp_schedule) == ("torch", "tp_plan", "torch", "1f1b")
    validate_parallel(SPEC, plan, hw(4))
    assert split_name(plan).startswith("tensor parallel 2 x pipeline parallel 2 (torch DTensor")


def test_zero3_with_autotp_is_refused_by_the_plan_itself():
    with pytest.raises(MemkitError, match=r"AutoTP training supports ZeRO 0-2"):
        validate_parallel(SPEC, tp_plan(2, zero_stage=3), hw(2))


def test_launched_world_must_match_the_degrees():
    with pytest.raises(MemkitError, match=r"dp\*pp\*tp = 1\*1\*2 = 2 but 4 processes were launched"):
        rank_layout(tp_plan(2), rank=0, world_size=4)


def test_driver_prints_one_line_and_exits_2(tmp_path):
    cfg = tmp_path / "bert.json"
    cfg.write_text(json.dumps({"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}))
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "parallel_train.py"), "--model-config", str(cfg),
                           "--tp", "2", "--out", str(tmp_path / "log.jsonl")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: tp=2 on {cfg} (encoder, bert)")
    assert "memkit splits decoder-only causal LMs only" in lines[0]


# ---- layout -------------------------------------------------------------------------------------

def test_rank_layout_is_dp_pp_tp_with_tp_innermost():
    plan = TrainingPlan(engine="torch", precision="fp32", dp=2, pp=2, grad_accum=2)
    places = [rank_layout(plan, rank=r, world_size=4).to_dict() for r in range(4)]
    assert places == [{"rank": 0, "dp_rank": 0, "pp_stage": 0, "tp_rank": 0},
                      {"rank": 1, "dp_rank": 0, "pp_stage": 1, "tp_rank": 0},
                      {"rank": 2, "dp_rank": 1, "pp_stage": 0, "tp_rank": 0},
                      {"rank": 3, "dp_rank": 1, "pp_stage": 1, "tp_rank": 0}]
    tp = rank_layout(tp_plan(2, dp=2), rank=3, world_size=4)
    # DeepSpeed's AutoTP mesh is (data_parallel, tensor_parallel): ranks 2,3 form a TP group.
    assert (tp.dp_rank, tp.tp_rank) == (1, 1)
    assert tp.rank_of(dp_rank=1, pp_stage=0, tp_rank=0) == 2


def test_autotp_config_counts_tp_ranks_in_deepspeeds_batch_check():
    from memkit.emit.deepspeed import deepspeed_config

    plan = tp_plan(2, dp=2, micro_batch_size=3, grad_accum=4)
    ds = autotp_deepspeed_config(deepspeed_config(plan, optimizer_block=False), plan)
    assert ds["tensor_parallel"] == {"autotp_size": 2}
    # deepspeed/runtime/config.py: train_batch_size == micro * accum * dist.get_world_size()
    assert ds["train_batch_size"] == 3 * 4 * 2 * 2
    with pytest.raises(MemkitError, match="ZeRO stage 3"):
        autotp_deepspeed_config({"zero_optimization": {"stage": 3}}, plan)


# ---- the stage split, per family ---------------------------------------------------------------

FAMILY_CONFIGS = {
    "llama": {},
    "mistral": {"sliding_window": 4},
    "qwen2": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2},
    "qwen3": {},
    "gemma": {},
    "gemma2": {"sliding_window": 4, "final_logit_softcapping": 3.0},
    "gemma3_text": {"sliding_window": 4},
    "phi3": {"pad_token_id": 0},
}


def test_every_splittable_family_is_covered():
    assert set(FAMILY_CONFIGS) == set(PP_MODEL_TYPES)
    assert set(TP_MODEL_TYPES) <= set(PP_MODEL_TYPES)


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_chained_stages_give_the_whole_models_logits(model_type):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memkit.train.parallel import split_stage_module

    base = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 5, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 128, "max_position_embeddings": 64}
    config = AutoConfig.for_model(model_type, **base, **FAMILY_CONFIGS[model_type])
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        for pp in (2, 3):
            x = ids
            for stage in range(pp):
                part = split_stage_module(copy.deepcopy(model), stage=stage, num_stages=pp)
                n_layers = len(getattr(part.lm, part.lm.base_model_prefix).layers)
                assert n_layers == stage_layers(5, pp)[stage]
                x = part(x)
            assert torch.equal(x, whole), f"{model_type} pp={pp}"
