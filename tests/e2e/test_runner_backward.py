"""The runner with activation offload and the optimizer in backward (memkit/plan/backward_techniques.py).

- One process, plain PyTorch, fp32 AdamW, 3 steps from plan.json: one run with both
  --optimizer-in-backward and --offload-activations cpu (copies forced on CPU, so pack and unpack
  really run) gives the plain run's losses and final parameters (measured: identical, each
  technique alone and both together; asserted 1e-6 relative).
- Activation offload under DeepSpeed ZeRO-3 on 2 CPU processes (ZeRO-3's gathered weights are
  Parameters, which the hook keeps as they are): test_runner_techniques.py, whose ZeRO-3 SGD run
  with the chunked loss and partial checkpointing also offloads (one launch instead of two here).
- --optimizer-in-backward on 2 processes is refused in one line, exit 2.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from runner_util import (FINETUNE, REPO, TEXT_DATA, env, events, final_params, launch, plan_document,
                         read_log, write_bundle, write_tiny_llama)

from memkit.plan.plan import TrainingPlan

pytestmark = pytest.mark.e2e
COMMON = ["--data", str(TEXT_DATA), "--max-steps", "3", "--lr", "1e-3", "--lr-decay", "constant",
          "--no-progress", "--report-to", "none"]


def _single(tmp_path, tiny, name, plan, extra=()):
    plan_path = tmp_path / f"plan-{name}.json"
    plan_path.write_text(json.dumps(plan_document(plan, num_gpus_per_node=1, num_nodes=1)))
    out = tmp_path / f"run-{name}"
    cmd = [sys.executable, str(FINETUNE), "--plan", str(plan_path), "--model", str(tiny), "--output-dir", str(out),
           *COMMON, *extra]
    result = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    log = read_log(out)
    start = events(log, "start")[-1]["plan"]
    assert (start["optimizer_in_backward"], start["offload_activations"]) == (
        plan.optimizer_in_backward, plan.offload_activations)
    return [s["loss"] for s in events(log, "step")], final_params(out / "final")


def _same(a, b, rel):
    (la, pa), (lb, pb) = a, b
    assert lb == pytest.approx(la, rel=rel)
    assert sorted(pa) == sorted(pb)
    for k in pa:
        assert float((pa[k] - pb[k]).abs().max()) <= rel * max(1e-12, float(pa[k].abs().max())), k


def test_single_process_optimizer_in_backward_and_offload_equal_the_plain_run(tmp_path):
    tiny = tmp_path / "tiny"
    write_tiny_llama(tiny)
    base = TrainingPlan(engine="torch", precision="fp32", optimizer="adamw", micro_batch_size=2, seq_len=64,
                        gradient_clipping=0.0)
    plain = _single(tmp_path, tiny, "plain", base)
    both = base.with_(optimizer_in_backward=True, offload_activations="cpu")
    _same(plain, _single(tmp_path, tiny, "inbwd-offload", both, extra=["--debug-offload-copy-on-cpu"]), 1e-6)
    assert plain[0][-1] < plain[0][0]


def test_optimizer_in_backward_refused_on_two_processes(tmp_path):
    tiny = tmp_path / "tiny"
    write_tiny_llama(tiny)
    plan = TrainingPlan(precision="fp32", zero_stage=2, optimizer="sgd", micro_batch_size=2, seq_len=64, dp=2)
    config, _ = write_bundle(tmp_path / "bundle", plan)
    result = launch(config, ["--model", str(tiny), "--output-dir", str(tmp_path / "run"), "--seq-len", "64",
                             "--optimizer-in-backward", *COMMON])
    assert result.returncode != 0
    assert "finetune: error: --optimizer-in-backward with engine deepspeed ZeRO-2" in result.stdout
    assert "MemkitError" not in result.stdout  # each rank says one line; the launcher's own report follows
