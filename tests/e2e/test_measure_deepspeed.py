"""Real 2-process DeepSpeed ZeRO-2 bf16 steps on CPU (gloo): the measured per-rank optimizer
state is exactly Adam's fp32 m and v for half the parameters (Rajbhandari et al. 2020, Sec. 5.1:
ZeRO partitions optimizer states across data-parallel ranks)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner_util import free_port

from memkit.plan.plan import TrainingPlan

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
# Every parameter's numel is a multiple of 8 and the total of 4, so DeepSpeed's flat-buffer
# alignment (deepspeed/runtime/zero/stage_1_and_2.py: 16-byte per-param alignment and
# nccl_start_alignment_factor * world_size for the group) adds no padding.
MODEL_CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                "max_position_embeddings": 128, "tie_word_embeddings": False}
PLAN = TrainingPlan(engine="deepspeed", precision="bf16", zero_stage=2, dp=2, micro_batch_size=2, seq_len=64,
                    attention="sdpa", reduce_bucket_size=20_000, allgather_bucket_size=20_000)


def _num_params() -> int:
    from memkit.calibrate.cpu_step import count_params

    return count_params(MODEL_CONFIG, PLAN.with_(engine="torch", dp=1, zero_stage=0))["num_params"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds")
    (tmp / "cfg.json").write_text(json.dumps(MODEL_CONFIG))
    (tmp / "plan.json").write_text(json.dumps(PLAN.to_dict()))
    # a free port: a fixed one collides with any other run of the suite on this host
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "memkit.calibrate.deepspeed_step", "--model-config", str(tmp / "cfg.json"),
           "--plan", str(tmp / "plan.json"), "--out", str(tmp / "out"), "--steps", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp / "out" / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_ranks_under_zero2(ranks):
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world_size"] == 2 for r in ranks)
    assert all(r["deepspeed_config"]["zero_optimization"]["stage"] == 2 for r in ranks)
    assert all(r["optimizer_class"] == "DeepSpeedZeroOptimizer" for r in ranks)


def test_optimizer_state_is_adam_m_and_v_for_half_the_params(ranks):
    num_params = _num_params()
    assert num_params == 2 * (512 * 64) + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 176 + 2 * 64) + 64
    for r in ranks:
        assert r["num_params"] == num_params
        # fp32 exp_avg + exp_avg_sq of this rank's partition (the 0-dim step counter excluded).
        assert r["boundary"]["after_step"]["optimizer_state_bytes"] == 8 * num_params // 2
        # bf16 params stay whole on every rank under ZeRO-2; the fp32 master copy is partitioned.
        assert r["boundary"]["after_step"]["params_bytes"] == 2 * num_params
        attrs = r["boundary"]["after_step"]["ds_optimizer_attributes_bytes"]
        assert attrs["single_partition_of_fp32_groups"] == 4 * num_params // 2
