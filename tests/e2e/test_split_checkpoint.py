"""Split runs a user can interrupt and keep: SIGTERM, checkpoint, resume, final HF folder.

A tiny Llama (fp32, 2 layers), `memkit suggest` bundles with --tp 2 / --pp 2 on 2 and 4 CPU
processes (gloo), text data, 4 optimizer steps of a global batch of 4 sequences. Per layout
(tp2, tp2 x dp2, pp2 1F1B, pp2 x dp2 GPipe, tp2 x pp2): rank 0 sends SIGTERM to the launcher after step 2,
the ranks checkpoint at the next step boundary (tp: DeepSpeed's engine checkpoint through
Accelerate; pp and tp x pp: torch.distributed.checkpoint under the unsplit FQNs), exit, and `--resume`
finishes the run. The resumed final folder equals the uninterrupted run's within RESUME_ATOL,
loads with AutoModelForCausalLM.from_pretrained and gives the trained ranks' logits (the
probe the run writes on its last step). Resharding: the pp2 1F1B checkpoint resumes as one plain
process (pp=1), the pp2 x dp2 checkpoint as pp2 x dp1; both end where the uninterrupted run does.
A tp checkpoint on another layout is one line, exit 2.

References: the uninterrupted unsplit single-process run (torch AdamW, what the pipeline runs
and pp=1 run), the uninterrupted tp2 run (DeepSpeed's AdamW and AutoTP's partial sums, for both
AutoTP layouts) and the uninterrupted tp2 x pp2 run (torch tensor parallel's partial sums: a
tensor-parallel run differs from the unsplit run by ~2e-6 after 4 Adam steps, measured, since
Adam's update amplifies the reduction-order difference of near-zero gradients).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memkit.cli.main import main

from runner_util import FINETUNE, REPO, TEXT_DATA, env, events, launch, read_log, write_tiny_llama

pytestmark = pytest.mark.e2e

RESUME_ATOL = 1e-6
"""max |param delta| between a resumed and an uninterrupted fp32 run: the tolerance
tests/e2e/test_runner.py uses for its fp32 resume (DeepSpeed CPU Adam's beta^t recomputed after a
restart, one ulp). Also the tolerance between layouts that share an optimizer (pp2 x dp2 / pp=1 vs
the unsplit run: summation order only). Measured: see the test's printout (pytest -s)."""
PROBE_ATOL = {"tp": 1e-5, "pp": 0.0}
"""Final folder vs trained ranks' logits: the pipeline's stage forwards are the unsplit forward
(bit-exact, measured 0.0); tensor-parallel row-parallel layers (AutoTP, torch DTensor under
tp x pp) all-reduce partial sums, the gathered model sums in one matmul (measured 2.4e-7)."""
STEPS, SIGNAL_AT = 4, 2
RUN = ["--data", str(TEXT_DATA), "--max-steps", str(STEPS), "--lr", "3e-3", "--seed", "0"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny")).parent


def _bundle(tiny: Path, folder: Path, gpus: int, pins: list[str], *, schedule: str | None = None) -> Path:
    assert main(["suggest", "--model", str(tiny), "--gpu", "a100-80gb", "--num-gpus", str(gpus),
                 "--global-batch-size", "4", "--seq-len", "32", "--max-micro-batch", "1", "--precision", "fp32",
                 "--out", str(folder), *pins]) == 0
    if schedule:  # the planner picks 1F1B; GPipe is accepted when pinned in plan.json
        doc = json.loads((folder / "plan.json").read_text())
        doc["plan"]["pp_schedule"] = schedule
        (folder / "plan.json").write_text(json.dumps(doc, indent=1))
    return folder


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-4000:]


def _single(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(FINETUNE), "--no-progress", *args], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=240)


def _max_delta(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _params(folder: Path) -> dict:
    from transformers import AutoModelForCausalLM

    return {k: v.detach() for k, v in AutoModelForCausalLM.from_pretrained(str(folder)).state_dict().items()}


def _probe_delta(run_dir: Path) -> float:
    from transformers import AutoModelForCausalLM

    probe = torch.load(run_dir / "probe_logits.pt")
    model = AutoModelForCausalLM.from_pretrained(str(run_dir / "final"))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits.float()
    assert logits.shape == probe["logits"].shape
    return float((logits - probe["logits"]).abs().max())


@pytest.fixture(scope="module")
def references(tiny, tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("refs")
    unsplit = root / "unsplit"
    _ok(_single(["--model", str(tiny), "--precision", "fp32", "--micro-batch-size", "1", "--grad-accum", "4",
                 "--seq-len", "32", "--output-dir", str(unsplit), *RUN]))
    out = {"unsplit": _params(unsplit / "final")}
    for name, gpus, pins in (("tp", 2, ["--tp", "2"]), ("tp2_pp2", 4, ["--tp", "2", "--pp", "2"])):
        bundle = _bundle(tiny, root / f"{name}-bundle", gpus, pins)
        _ok(launch(bundle / "accelerate.yaml", ["--plan", str(bundle / "plan.json"), "--output-dir",
                                                str(root / name), *RUN]))
        out[name] = _params(root / name / "final")
    return out


LAYOUTS = {
    # name: (GPUs, suggest pins, schedule, reference, degrees)
    "tp2": (2, ["--tp", "2"], None, "tp", {"dp": 1, "tp": 2, "pp": 1}),
    "tp2_dp2": (4, ["--tp", "2"], None, "tp", {"dp": 2, "tp": 2, "pp": 1}),
    "pp2_1f1b": (2, ["--pp", "2"], None, "unsplit", {"dp": 1, "tp": 1, "pp": 2}),
    "pp2_dp2_gpipe": (4, ["--pp", "2"], "gpipe", "unsplit", {"dp": 2, "tp": 1, "pp": 2}),
    "tp2_pp2": (4, ["--tp", "2", "--pp", "2"], None, "tp2_pp2", {"dp": 1, "tp": 2, "pp": 2}),
}


@pytest.fixture(scope="module")
def interrupted(tiny, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Each layout's bundle and its run stopped by SIGTERM after step SIGNAL_AT (then resumed)."""
    out = {}
    for name, (gpus, pins, schedule, _, _) in LAYOUTS.items():
        root = tmp_path_factory.mktemp(name)
        bundle = _bundle(tiny, root / "bundle", gpus, pins, schedule=schedule)
        run_dir = root / "run"
        common = ["--plan", str(bundle / "plan.json"), "--output-dir", str(run_dir), *RUN]
        stopped = launch(bundle / "accelerate.yaml", [*common, "--debug-signal-at-step", str(SIGNAL_AT)])
        assert stopped.returncode != 0, stopped.stdout[-3000:]
        log = read_log(run_dir)
        end = events(log, "end")[-1]
        assert end["status"] == "interrupted" and SIGNAL_AT <= end["steps_done"] < STEPS, end
        assert [r["step"] for r in events(log, "checkpoint")] == [end["steps_done"]]
        assert not (run_dir / "final").exists()
        keep = root / "stopped-checkpoint"  # a copy for the resharding test (the resume adds its own)
        shutil.copytree(run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip(), keep)
        _ok(launch(bundle / "accelerate.yaml", [*common, "--resume"]))
        out[name] = (bundle, run_dir, keep)
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sigterm_resume_ends_where_the_uninterrupted_run_does(name, interrupted, references):
    _, run_dir, _ = interrupted[name]
    gpus, _, schedule, ref, degrees = LAYOUTS[name]
    log = read_log(run_dir)
    starts = events(log, "start")
    assert len(starts) == 2 and starts[-1]["degrees"] == degrees and starts[-1]["world_size"] == gpus
    if schedule:
        assert starts[-1]["plan"]["pp_schedule"] == schedule
    stop_step = events(log, "end")[0]["steps_done"]
    assert starts[-1]["start_step"] == stop_step
    assert [r["step"] for r in events(log, "step")] == list(range(1, stop_step + 1)) + list(range(stop_step + 1, STEPS + 1))
    assert events(log, "end")[-1]["status"] == "ok"
    delta = _max_delta(_params(run_dir / "final"), references[ref])
    probe = _probe_delta(run_dir)
    print(f"\n{name}: stopped at step {stop_step}; resumed final vs uninterrupted ({ref}) max |delta| {delta:.1e}; "
          f"final folder vs trained ranks' logits max |delta| {probe:.1e}")
    assert delta <= RESUME_ATOL
    assert probe <= PROBE_ATOL[name[:2]]


def test_pipeline_checkpoint_reshards(interrupted, references, tiny, tmp_path):
    """pp2 -> one plain process (pp=1, dp=1); pp2 x dp2 -> pp2 x dp1 (DCP reads the FQNs it needs)."""
    _, _, pp_ckpt = interrupted["pp2_1f1b"]
    one = tmp_path / "pp1"
    _ok(_single(["--model", str(tiny), "--precision", "fp32", "--micro-batch-size", "1", "--grad-accum", "4",
                 "--seq-len", "32", "--output-dir", str(one), "--resume", str(pp_ckpt), *RUN]))
    bundle = interrupted["pp2_1f1b"][0]
    _, _, dp2_ckpt = interrupted["pp2_dp2_gpipe"]
    two = tmp_path / "pp2_from_dp2"
    _ok(launch(bundle / "accelerate.yaml", ["--plan", str(bundle / "plan.json"), "--output-dir", str(two),
                                            "--resume", str(dp2_ckpt), *RUN]))
    for run_dir, layout in ((one, "dp 1 x tp 1 x pp 1"), (two, "dp 1 x tp 1 x pp 2")):
        start = events(read_log(run_dir), "start")[-1]
        assert start["start_step"] >= SIGNAL_AT and start["resumed_from"]
        delta = _max_delta(_params(run_dir / "final"), references["unsplit"])
        print(f"\nresharded onto {layout}: final vs uninterrupted unsplit max |delta| {delta:.1e}")
        assert delta <= RESUME_ATOL


def test_tensor_parallel_checkpoint_on_another_layout_is_one_line(interrupted, tmp_path):
    """Refused before any process group, as a launched rank 0 would see it."""
    bundle, _, _ = interrupted["tp2"]
    _, _, dp2_ckpt = interrupted["tp2_dp2"]
    proc = subprocess.run([sys.executable, str(FINETUNE), "--plan", str(bundle / "plan.json"), "--output-dir",
                           str(tmp_path / "x"), "--resume", str(dp2_ckpt), *RUN], cwd=REPO,
                          env={**env(), "WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "2"},
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if "real_accelerator.py" not in line]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines == [f"finetune: error: --resume {dp2_ckpt}: written by dp 2 x tp 2 x pp 1, this run is dp 1 x "
                     "tp 2 x pp 1; a tensor-parallel checkpoint resumes on the same tp x dp layout only "
                     "(DeepSpeed AutoTP shards are not resharded; pipeline checkpoints are); resume with the "
                     "checkpoint's plan"], lines
