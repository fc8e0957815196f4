"""Damaged checkpoints under 2-process ZeRO-2 and ZeRO-3 (CPU, gloo, the real DeepSpeed):
every kind of damage is named in one line, the run falls back to the newest intact checkpoint
(and says so), and its final parameters equal an uninterrupted run's.

Cheap by construction: per ZeRO stage one uninterrupted reference run that checkpoints after
every step (steps 1-6 of 7; the ZeRO-2 one is tests/e2e/shared_ckpt_runs.py's, shared with
test_checkpoint_trust_e2e.py), then ONE resumed launch over a copy of those checkpoints in which the
five newest are damaged in five different ways (newest first):

  step 6: a model-states file truncated      step 5: a model-states file overwritten with random bytes
  step 4: an optimizer partition deleted     step 3: trainer_state.json replaced by garbage
  step 2: random_states_0.pkl truncated (Accelerate would skip it silently; the manifest does not)

so the resume must walk past all five to step 1 and train steps 2-7 again.
Tolerance as tests/e2e/test_runner.py (fp32, DeepSpeed's CPU Adam: one float32 ulp in the bias
correction after a restart; 1e-6).
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from runner_util import events, final_params, launch, read_log
from shared_ckpt_runs import Reference, reference_run, step_name as _step, zero2_reference

pytestmark = pytest.mark.e2e
__all__ = ["zero2_reference"]  # the shared session fixture, imported for pytest to find


def _one(folder: Path, pattern: str) -> Path:
    found = sorted(p for p in folder.rglob("*") if p.is_file() and re.search(pattern, p.name))
    assert found, f"no {pattern} under {folder}: {sorted(p.name for p in folder.rglob('*'))}"
    return found[0]


def _damage(ckpts: Path) -> dict[int, str]:
    """Damage steps 6..2 in five ways; return step -> the file name the error line must name."""
    named = {}
    model_states = _one(ckpts / _step(6), r"model_states\.pt$")
    model_states.write_bytes(model_states.read_bytes()[: model_states.stat().st_size // 2])
    named[6] = model_states.name
    other = _one(ckpts / _step(5), r"model_states\.pt$")
    other.write_bytes(os.urandom(other.stat().st_size))
    named[5] = other.name
    optim = _one(ckpts / _step(4), r"rank_1.*optim_states\.pt$")
    optim.unlink()
    named[4] = optim.name
    (ckpts / _step(3) / "trainer_state.json").write_text('{"step": 3, "tokens_seen": ')
    named[3] = "trainer_state.json"
    rng = ckpts / _step(2) / "random_states_0.pkl"
    rng.write_bytes(rng.read_bytes()[:40])
    named[2] = rng.name
    return named


@pytest.fixture(scope="module")
def zero3_reference(tmp_path_factory) -> Reference:
    return reference_run(tmp_path_factory, zero=3)


@pytest.mark.parametrize("zero", [2, 3])
def test_damaged_checkpoints_fall_back_to_the_newest_intact_one(request, tmp_path, zero):
    ref = request.getfixturevalue("zero2_reference" if zero == 2 else "zero3_reference")
    config, common, whole = ref.config, ref.args(), ref.whole
    damaged = tmp_path / "damaged"
    ckpts = whole / "checkpoints"
    shutil.copytree(ckpts, damaged / "checkpoints")
    named = _damage(damaged / "checkpoints")
    result = launch(config, [*common, "--output-dir", str(damaged), "--resume"], timeout_s=900)  # hang guard only
    assert result.returncode == 0, result.stdout[-4000:]
    lines = result.stdout.splitlines()
    for step, name in named.items():  # one line per damaged checkpoint, naming the file
        hits = [line for line in lines if f"checkpoint {damaged / 'checkpoints' / _step(step)} is damaged" in line]
        assert len(hits) == 1 and name in hits[0], (step, name, hits)
    fallback = [line for line in lines if "resuming from " + _step(1) in line]
    assert len(fallback) == 1 and "5 damaged" in fallback[0], fallback
    assert "Traceback" not in result.stdout
    assert events(read_log(damaged), "start")[-1]["start_step"] == 1

    pa, pb = final_params(whole / "final"), final_params(damaged / "final")
    assert sorted(pa) == sorted(pb)
    worst = max(float((pa[k].float() - pb[k].float()).abs().max()) for k in pa)
    assert worst <= 1e-6, f"max |delta| {worst}"
