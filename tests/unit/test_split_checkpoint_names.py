"""Split-run checkpoints without processes: the stage FQNs are the unsplit model's, a DCP
checkpoint of the whole model loads into one pipeline stage (the resharding path), the tp layout
check is one line, and launch-script keeps TP groups inside a node."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from memkit.errors import MemkitError
from memkit.plan.parallel import stage_layers
from memkit.plan.plan import TrainingPlan
from memkit.train import split_checkpoint as sc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from runner_util import write_bundle  # noqa: E402

LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64,
         "tie_word_embeddings": False}


class _Stage:
    """What stage_fqns reads of a PipelineParallel: .module (the cut model) and .first_layer."""

    def __init__(self, model, stage: int, pp: int):
        from memkit.train.parallel import split_stage_module

        counts = stage_layers(model.config.num_hidden_layers, pp)
        self.first_layer = sum(counts[:stage])
        self.module = split_stage_module(model, stage=stage, num_stages=pp, layer_counts=counts)


def _model(seed: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA))


def test_stage_names_are_the_unsplit_models():
    whole = set(dict(_model(0).named_parameters()))
    first, last = sc.stage_fqns(_Stage(_model(0), 0, 2)), sc.stage_fqns(_Stage(_model(0), 1, 2))
    assert set(first) | set(last) == whole and not set(first) & set(last)
    assert "model.layers.3.mlp.down_proj.weight" in last and "model.layers.1.mlp.down_proj.weight" in first
    assert "lm_head.weight" in last and "model.embed_tokens.weight" in first


def test_whole_model_checkpoint_loads_into_a_stage(tmp_path):
    """Written by one unsplit process (as pp=1 writes), read by stage 1 of 2: parameters and AdamW
    states land on the parameters of the same FQN."""
    src = _model(0)
    opt = torch.optim.AdamW(src.parameters(), lr=1e-2)
    src(input_ids=torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
    opt.step()
    sc.save_dcp(tmp_path, dict(src.named_parameters()), opt)

    stage = _Stage(_model(1), 1, 2)
    params = sc.stage_fqns(stage)
    dst_opt = torch.optim.AdamW(params.values(), lr=1e-2)
    sc.load_dcp_into(tmp_path, params, dst_opt)
    want = dict(src.named_parameters())
    for fqn, p in params.items():
        assert torch.equal(p, want[fqn]), fqn
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(dst_opt.state[p][key], opt.state[want[fqn]][key]), (fqn, key)


def test_tp_checkpoint_on_another_layout_is_refused(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step-00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"plan": {"dp": 2, "tp": 2, "pp": 1}}))
    tp2 = TrainingPlan(tp=2, dp=1, micro_batch_size=1, seq_len=32)
    with pytest.raises(MemkitError, match=r"written by dp 2 x tp 2 x pp 1, this run is dp 1 x tp 2 x pp 1; "
                                          r"a tensor-parallel checkpoint resumes on the same tp x dp layout only"):
        sc.check_resume_layout(tp2, "latest", tmp_path)
    sc.check_resume_layout(tp2.with_(dp=2), "latest", tmp_path)  # the same layout resumes
    sc.check_resume_layout(tp2, None, tmp_path)
    pp2 = TrainingPlan(pp=2, engine="torch", zero_stage=0, grad_accum=2, micro_batch_size=1, seq_len=32)
    (ckpt / "trainer_state.json").write_text(json.dumps({"plan": {"dp": 2, "tp": 1, "pp": 1}}))
    with pytest.raises(MemkitError, match=r"written by a dp 2 x tp 1 x pp 1 run as DeepSpeed/Accelerate state, "
                                          r"which a pipeline cannot read"):
        sc.check_resume_layout(pp2, str(ckpt), tmp_path)
    (ckpt / "trainer_state.json").write_text(json.dumps({"plan": {"dp": 2, "tp": 1, "pp": 1}, "format": sc.FORMAT_DCP}))
    sc.check_resume_layout(pp2, str(ckpt), tmp_path)  # a torch-engine DCP checkpoint reshards onto pp=2


def test_launch_script_for_a_split_plan(tmp_path, capsys):
    from memkit.cli.main import main

    plan = TrainingPlan(precision="fp32", zero_stage=1, micro_batch_size=1, seq_len=64, dp=2, tp=2)
    _, plan_path = write_bundle(tmp_path, plan, num_gpus_per_node=2, num_nodes=2)
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=2\nnode-b slots=2\n")
    out = tmp_path / "run.sh"
    assert main(["launch-script", "--plan", str(plan_path), "--hostfile", str(hosts), "--out", str(out)]) == 0
    assert "2 nodes x 2 processes (dp 2 x tp 2 x pp 1)" in capsys.readouterr().out
    assert "--num_machines 2 --num_processes 4" in out.read_text()
    hosts.write_text("a slots=1\nb slots=1\nc slots=1\nd slots=1\n")
    assert main(["launch-script", "--plan", str(plan_path), "--hostfile", str(hosts), "--num-machines", "4"]) == 2
    assert capsys.readouterr().err.strip() == ("memkit: error: tp=2 with 1 processes per node: a TP group would "
                                               "span nodes; use --gpus-per-node a multiple of 2")

