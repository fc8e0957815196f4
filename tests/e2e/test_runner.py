"""The runner end to end: `accelerate launch` with 2 CPU processes and the real DeepSpeed, on a tiny
Llama (hidden 64, 2 layers) and the shipped data sets. Config files come from memkit.emit.

Each run is asserted from inside (world size, distributed type and backend logged by rank 0),
and several properties are checked per run to keep the suite short:

  ZeRO-2 fp32:               loss falls; saved folder gives the run's logits; crash mid-save
                             leaves the last good checkpoint; resume == uninterrupted
  ZeRO-3 bf16 + CPU offload: SIGTERM through the launcher -> checkpoint -> resume == uninterrupted;
                             ZeRO-3 shards gathered into a folder with the run's logits
  (the two uninterrupted runs are `memkit suggest --out` bundles, launched once per session and
  shared with test_suggest_runs.py: tests/e2e/shared_runner_runs.py)
  ZeRO-0 fp32, SGD:          micro 1 x accum 4 == micro 4 x accum 1 after one step
  ZeRO-3 fp32 (verify):      predicted vs measured report; a simulated OOM is a result, not a hang

Resume tolerance: DeepSpeed's CPU Adam (the FusedAdam/DeepSpeedCPUAdam kernels DeepSpeed builds on
CPU) updates beta^t incrementally in a live run but recomputes it with pow() after a restart
(deepspeed/ops/csrc/includes/cpu_adam.h, Adam_Optimizer::IncrementStep), so a resumed run can differ
by one float32 ulp in the bias correction: measured max |delta param| 1.2e-7 (fp32). With torch AdamW
(no optimizer block) the same resume is bit-exact (measured 0.0).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner_util import (QA_DATA, REPO, TEXT_DATA, env, events, final_params, free_port, launch, read_log,
                         write_bundle, write_tiny_llama)
from shared_runner_runs import suggested_zero2, suggested_zero3_offload  # noqa: F401 (session fixtures)

from memkit.plan.plan import TrainingPlan

pytestmark = pytest.mark.e2e
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SMALL_BUCKETS = dict(reduce_bucket_size=1_000_000, allgather_bucket_size=1_000_000,
                     stage3_prefetch_bucket_size=1_000_000, stage3_param_persistence_threshold=1_000)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_llama(folder)
    return folder


def _ok(result):
    assert result.returncode == 0, result.stdout[-4000:]


def _start(log: list[dict], *, zero: int) -> dict:
    start = events(log, "start")[-1]
    assert start["world_size"] == 2
    assert start["distributed_type"] == "DEEPSPEED" and start["backend"] == "gloo"
    assert start["deepspeed_config"]["zero_optimization"]["stage"] == zero
    return start


def _assert_logits_match(run_dir: Path, *, atol: float) -> None:
    from transformers import AutoModelForCausalLM

    probe = torch.load(run_dir / "probe_logits.pt")
    model = AutoModelForCausalLM.from_pretrained(str(run_dir / "final"))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits.float()
    assert str(model.dtype) == probe["dtype"]
    torch.testing.assert_close(logits, probe["logits"], rtol=0, atol=atol)


def _assert_same_params(a: Path, b: Path, *, atol: float) -> None:
    pa, pb = final_params(a), final_params(b)
    assert sorted(pa) == sorted(pb)
    worst = max(float((pa[k].float() - pb[k].float()).abs().max()) for k in pa)
    assert worst <= atol, f"max |delta| {worst}"


def test_zero2_fp32_crash_mid_save_then_resume(tmp_path, suggested_zero2):
    """The uninterrupted run is `memkit suggest --zero 2 --precision fp32`'s bundle launched as
    written (tests/e2e/shared_runner_runs.py), which test_suggest_runs.py reads too."""
    config, common, whole = suggested_zero2.config, list(suggested_zero2.args), suggested_zero2.whole
    broken = tmp_path / "broken"
    assert common[common.index("--save-every") + 1] == "2" and suggested_zero2.max_steps == 6

    log = read_log(whole)
    start = _start(log, zero=2)
    assert start["plan"]["precision"] == "fp32"
    losses = [r["loss"] for r in events(log, "step")]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5
    end = events(log, "end")[-1]
    assert end["status"] == "ok" and end["measured"]["memory_kind"] == "live-tensors"
    assert end["measured"]["allocated_peak_bytes"] > 0 and end["predicted"]["allocated_peak_bytes"] > 0
    _assert_logits_match(whole, atol=0.0)

    # A crash (hard exit of every rank) after the step-4 state is written but before it is published.
    crashed = launch(config, [*common, "--output-dir", str(broken), "--debug-crash-in-save-at-step", "4"])
    assert crashed.returncode != 0
    ckpts = broken / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-00000002"
    assert (ckpts / ".tmp-step-00000004").is_dir() and not (ckpts / "step-00000004").exists()

    _ok(launch(config, [*common, "--output-dir", str(broken), "--resume"]))
    log2 = read_log(broken)
    assert events(log2, "start")[-1]["start_step"] == 2
    resumed = {r["step"]: r["loss"] for r in events(log2, "step")[4:]}  # steps 3..6 of the resumed run
    assert sorted(resumed) == [3, 4, 5, 6]
    for step, loss in resumed.items():
        assert loss == pytest.approx(losses[step - 1], rel=1e-6)
    _assert_same_params(whole / "final", broken / "final", atol=1e-6)


def test_zero3_bf16_offload_sigterm_then_resume(tmp_path, suggested_zero3_offload):
    """The uninterrupted run is `memkit suggest --zero 3 --offload-optimizer cpu --offload-params cpu`'s
    bundle (bf16, micro 2 x accum 2, ZeRO-3 partitioning every weight over 640 elements) launched as
    written (tests/e2e/shared_runner_runs.py), which test_suggest_runs.py reads too."""
    config, common, whole = (suggested_zero3_offload.config, list(suggested_zero3_offload.args),
                             suggested_zero3_offload.whole)
    stopped = tmp_path / "stopped"
    assert suggested_zero3_offload.max_steps == 8

    log = read_log(whole)
    start = _start(log, zero=3)
    assert start["deepspeed_config"]["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert start["deepspeed_config"]["zero_optimization"]["stage3_param_persistence_threshold"] < 64 * 64
    assert start["plan"]["precision"] == "bf16"
    losses = [r["loss"] for r in events(log, "step")]
    assert losses[-1] < losses[0] - 0.5
    _assert_logits_match(whole, atol=0.0)  # ZeRO-3 partitions gathered into one folder

    # Rank 0 sends SIGTERM to the launcher after step 2; torchrun forwards it to both ranks.
    result = launch(config, [*common, "--output-dir", str(stopped), "--debug-signal-at-step", "2"])
    assert result.returncode != 0
    log2 = read_log(stopped)
    end = events(log2, "end")[-1]
    stop_step = end["steps_done"]
    assert end["status"] == "interrupted" and 2 <= stop_step < 8
    assert [r["step"] for r in events(log2, "checkpoint")] == [stop_step]
    assert not (stopped / "final").exists()

    _ok(launch(config, [*common, "--output-dir", str(stopped), "--resume"]))
    assert events(read_log(stopped), "start")[-1]["start_step"] == stop_step
    # bf16 weights are rounded from fp32 masters that may differ by one ulp (see module docstring).
    _assert_same_params(whole / "final", stopped / "final", atol=2 ** -8)


def test_grad_accum_micro1x4_equals_micro4x1(tmp_path, tiny):
    """One SGD step (update = lr * grad, so a wrongly scaled gradient shows) on prompt/completion
    data whose micro-batches hold different numbers of target tokens."""
    runs = {}
    for micro, accum in ((1, 4), (4, 1)):
        plan = TrainingPlan(precision="fp32", zero_stage=0, optimizer="sgd", micro_batch_size=micro,
                            grad_accum=accum, seq_len=64, dp=2, gradient_clipping=0.0)
        config, plan_path = write_bundle(tmp_path / f"b{micro}x{accum}", plan)
        out = tmp_path / f"run{micro}x{accum}"
        _ok(launch(config, ["--plan", str(plan_path), "--model", str(tiny), "--data", str(QA_DATA),
                            "--max-steps", "1", "--lr", "0.5", "--lr-decay", "constant",
                            "--output-dir", str(out)]))
        log = read_log(out)
        start = _start(log, zero=0)
        assert (start["plan"]["micro_batch_size"], start["plan"]["grad_accum"]) == (micro, accum)
        runs[(micro, accum)] = (out, events(log, "step")[0])
    (a, step_a), (b, step_b) = runs[(1, 4)], runs[(4, 1)]
    assert step_a["target_tokens"] == step_b["target_tokens"]
    assert step_a["loss"] == pytest.approx(step_b["loss"], rel=1e-6)
    _assert_same_params(a / "final", b / "final", atol=2e-6)
    # ... and the step moved the weights far beyond that tolerance.
    from memkit.train.model import build_model, load_config, resolve_model

    source = resolve_model(str(tiny))
    init = build_model(source, load_config(source), attention="sdpa", seed=0).state_dict()
    trained = final_params(a / "final")
    assert max(float((trained[k] - init[k]).abs().max()) for k in trained) > 1e-3


def test_two_machines_rendezvous_on_localhost(tmp_path, tiny):
    """`memkit launch-script --hostfile`, started as machine rank 0 and 1 on 127.0.0.1: the two
    launchers form one world of 2. The plan also exercises ZeRO-2 + bf16 + optimizer offload,
    LoRA and activation checkpointing; the saved folder has the LoRA merged in."""
    from memkit.cli.main import main

    plan = TrainingPlan(precision="bf16", zero_stage=2, offload_optimizer="cpu", micro_batch_size=2,
                        grad_accum=1, seq_len=64, dp=2, lora_rank=8, lora_alpha=16, lora_dropout=0.0,
                        lora_targets=LINEARS, checkpointing="full", **SMALL_BUCKETS)
    _, plan_path = write_bundle(tmp_path / "bundle", plan, num_gpus_per_node=1, num_nodes=2)
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 slots=1\n127.0.0.1 slots=1\n")
    script, out = tmp_path / "run.sh", tmp_path / "out"
    assert main(["launch-script", "--plan", str(plan_path), "--hostfile", str(hosts), "--out", str(script),
                 "--python", sys.executable, "--", "--model", str(tiny), "--data", str(TEXT_DATA),
                 "--output-dir", str(out), "--max-steps", "5", "--lr", "1e-2", "--lr-decay", "constant",
                 "--no-progress"]) == 0
    port = str(free_port())
    procs = [subprocess.Popen(["bash", str(script), "--node"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True,
                              env={**env(), "MACHINE_RANK": str(rank), "MEMKIT_MASTER_PORT": port})
             for rank in (0, 1)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=240)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    log = read_log(out)
    start = _start(log, zero=2)
    # LoRA r=8 adds r * (in + out) per linear: q, o 64->64; k, v 64->32 (2 kv heads x 16);
    # gate, up 64->128; down 128->64; 2 layers.
    per_layer = 8 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 128))
    assert start["num_trainable_params"] == 2 * per_layer == 16384
    losses = [r["loss"] for r in events(log, "step")]
    assert losses[-1] < losses[0] - 0.25
    _assert_logits_match(out, atol=0.05)  # merged in bf16: W + BA rounded once more


def test_verify_reports_prediction_and_oom(tmp_path, tiny):
    plan = TrainingPlan(precision="fp32", zero_stage=3, micro_batch_size=1, grad_accum=2, seq_len=64, dp=2,
                        **SMALL_BUCKETS)
    config, plan_path = write_bundle(tmp_path / "bundle", plan)
    doc = json.loads(plan_path.read_text())
    # an alternative as suggest writes it (emit/plan_doc.py candidate_dict; memkit/plan/plan_schema.py checks it)
    est, speed = doc["estimate"], doc["step_time"]
    doc["alternatives"] = [{"label": "zero3+offload", "plan": {**doc["plan"], "offload_optimizer": "cpu"},
                            "allocated_peak_bytes": est["allocated_peak_bytes"] // 2,
                            "nvidia_smi_peak_bytes": est["nvidia_smi_peak_bytes"] // 2,
                            "step_time_s": speed["step_time_s"], "tokens_per_s": speed["tokens_per_s"],
                            "mfu": speed["mfu"]}]
    plan_path.write_text(json.dumps(doc))
    cmd = [sys.executable, "-m", "memkit.cli.main", "verify", "--plan", str(plan_path), "--model", str(tiny),
           "--steps", "3", "--timeout-s", "240"]
    profile_path = tmp_path / "profile.json"
    ok = subprocess.run([*cmd, "--output-dir", str(tmp_path / "ok"), "--json"], capture_output=True, text=True,
                        env={**env(), "MEMKIT_PROFILE": str(profile_path)}, cwd=REPO, timeout=300)
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    report = json.loads(ok.stdout)
    assert report["status"] == "ok" and report["steps_done"] == 3 and report["world_size"] == 2
    assert report["predicted"]["allocated_peak_bytes"] == doc["estimate"]["allocated_peak_bytes"]
    assert report["measured"]["allocated_peak_bytes"] > 0
    assert report["measured_over_predicted"]["allocated_peak_bytes"] > 0
    assert report["measured"]["tokens_per_s"] > 0
    # the run is in the local profile (memkit/profile.py), against memkit's CPU estimate of the plan
    from memkit import profile
    from memkit.spec.stack import installed
    assert report["profile_runs"] == 1, report.get("profile_error")
    run = json.loads(profile_path.read_text())["machines"][profile.machine_key("cpu", installed())]["runs"][0]
    assert run["measured"]["allocated_peak_bytes"] == report["measured"]["allocated_peak_bytes"]
    table, n = profile.margins("cpu", installed(), profile_path)
    assert n == 1 and "all" in table

    oom = subprocess.run([*cmd, "--output-dir", str(tmp_path / "oom")], capture_output=True, text=True,
                         env={**env(), "MEMKIT_DEBUG_OOM_AT_STEP": "2"}, cwd=REPO, timeout=300)
    assert oom.returncode == 3, oom.stdout[-2000:] + oom.stderr[-2000:]
    lines = oom.stdout.strip().splitlines()
    assert lines[0].startswith("memkit verify: OUT OF MEMORY at step 2 on rank 0: CUDA out of memory")
    assert "next-ranked plan that should fit: zero3+offload" in lines[-1]
    assert "Traceback" not in oom.stdout + oom.stderr
