"""PYTORCH_CUDA_ALLOC_CONF as a stated plan fact (TrainingPlan.alloc_conf, issue 20 item 2): what the runner
sets, what bundles and launch scripts export, what plan.json records, what the estimate prices, and the
one line when a user's own setting differs from the priced one."""
from __future__ import annotations

from memkit.cli.estimate import alloc_conf_note
from memkit.cli.launch_script import alloc_line
from memkit.emit.bundle import alloc_conf_lines
from memkit.estimate.memory import estimate_memory
from memkit.plan.plan import ALLOC_CONF_ENV, TrainingPlan, alloc_conf_of
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec
from memkit.train.main import set_alloc_conf


def test_the_setting_each_value_runs():
    assert TrainingPlan().alloc_conf == "expandable" and ALLOC_CONF_ENV["expandable"] == "expandable_segments:True"
    assert alloc_conf_of(None) == "default" and alloc_conf_of("max_split_size_mb:128") == "default"
    assert alloc_conf_of("max_split_size_mb:512, expandable_segments:True") == "expandable"
    assert alloc_conf_of("expandable_segments:False") == "default"
    assert TrainingPlan().to_dict()["alloc_conf"] == "expandable"  # plan.json records it
    assert TrainingPlan.from_dict({**TrainingPlan().to_dict(), "alloc_conf": "default"}).alloc_conf == "default"


def test_runner_sets_the_priced_setting_unless_the_user_did():
    env: dict[str, str] = {}
    assert set_alloc_conf(env) == "" and env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    env = {}
    assert set_alloc_conf(env, wanted="default") == "" and "PYTORCH_CUDA_ALLOC_CONF" not in env
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    note = set_alloc_conf(mine)
    assert mine["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"  # kept
    assert "max_split_size_mb:128" in note and "--alloc-conf expandable" in note and "\n" not in note
    assert set_alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512"}) == ""
    assert "--alloc-conf default" in set_alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                                                    wanted="default")


def test_one_line_when_the_shell_setting_differs_from_the_priced_one():
    assert alloc_conf_note("expandable", {}) == ""
    assert alloc_conf_note("expandable", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) == ""
    line = alloc_conf_note("expandable", {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"})
    assert "--alloc-conf expandable" in line and "pass --alloc-conf default" in line and "\n" not in line
    line = alloc_conf_note("default", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert "pass --alloc-conf expandable" in line


def test_bundle_readme_and_launch_scripts_export_the_priced_setting():
    lines = "\n".join(alloc_conf_lines(TrainingPlan().to_dict()))
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in lines
    default = "\n".join(alloc_conf_lines(TrainingPlan(alloc_conf="default").to_dict()))
    assert "export" not in default and "--alloc-conf default" in default
    assert 'PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True' in alloc_line("expandable")
    assert "export" not in alloc_line("default")


def test_an_expandable_run_is_priced_by_the_default_replay():
    # memory.py EXPANDABLE_REPLAY_IN_ESTIMATES: the expandable replay read 7.2 % low on the measured
    # expandable runs (torchtitan), so the fixed-shape estimate prices either setting by the default
    # replay; the expandable rules still run in the variable-length replay, where the same step
    # (one growing segment per pool, 20 MiB pages; always split at 512 B) strands no slivers
    from memkit.estimate.memory import EXPANDABLE_REPLAY_IN_ESTIMATES
    from memkit.estimate.varlen import estimate_varlen

    model = load_model_spec("llama-3.2-1b")
    hw = Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=1)
    plan = TrainingPlan(engine="torch", micro_batch_size=2, seq_len=1024, lora_rank=8)
    exp, dflt = (estimate_memory(model, plan.with_(alloc_conf=a), hw) for a in ("expandable", "default"))
    assert not EXPANDABLE_REPLAY_IN_ESTIMATES
    assert (exp.components, exp.reserved_peak_bytes, exp.nvidia_smi_peak_bytes) == \
        (dflt.components, dflt.reserved_peak_bytes, dflt.nvidia_smi_peak_bytes)
    grown, segments = (estimate_varlen(model, plan, hw, [1024], expandable_segments=e) for e in (True, False))
    assert grown.allocated_peak_bytes <= segments.allocated_peak_bytes
    assert grown.reserved_peak_bytes < segments.reserved_peak_bytes
    cpu = [estimate_memory(model, plan.with_(alloc_conf=a), hw, device="cpu").reserved_peak_bytes
           for a in ("expandable", "default")]
    assert cpu[0] == cpu[1]  # the CPU allocator has no segments
