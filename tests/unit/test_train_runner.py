"""Runner pieces that need no process group: plan reconciliation, LR schedule and scaling, loss
normalisation over an accumulation window, LoRA merging, checkpoint discovery, launch scripts."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memkit.errors import MemkitError
from memkit.plan.plan import TrainingPlan
from memkit.train.config import fill_deepspeed_autos, knobs_from_deepspeed, lr_at, resolve_plan, scaled_lr

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from runner_util import TINY_LLAMA, write_bundle  # noqa: E402

DS_Z2 = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
         "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": True},
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


# ---- plan reconciliation ---------------------------------------------------------------------------

def test_deepspeed_file_decides_zero_offload_precision_batch():
    assert knobs_from_deepspeed(DS_Z2) == {"zero_stage": 2, "offload_optimizer": "cpu", "offload_params": "none",
                                           "precision": "bf16", "optimizer": "adamw", "micro_batch_size": 2,
                                           "grad_accum": 4, "gradient_clipping": 1.0, "tp": 1}
    plan = resolve_plan(plan=None, flags={"seq_len": 128}, ds_config=DS_Z2, world_size=2,
                        distributed_type="DEEPSPEED")
    assert (plan.zero_stage, plan.offload_optimizer, plan.precision, plan.micro_batch_size, plan.grad_accum,
            plan.dp, plan.seq_len, plan.engine) == (2, "cpu", "bf16", 2, 4, 2, 128, "deepspeed")
    assert plan.global_batch_size == 16


def test_plan_and_deepspeed_file_must_agree():
    plan = TrainingPlan(zero_stage=3, precision="bf16", micro_batch_size=2, grad_accum=4, dp=2,
                        offload_optimizer="cpu")
    with pytest.raises(MemkitError, match=r"disagree \(zero_stage: plan 3 vs file 2\)"):
        resolve_plan(plan=plan, flags={}, ds_config=DS_Z2, world_size=2, distributed_type="DEEPSPEED")


def test_flag_contradicting_plan_or_file():
    plan = TrainingPlan(seq_len=2048, dp=1)
    with pytest.raises(MemkitError, match=r"--seq-len 512 contradicts plan.json \(seq_len=2048\)"):
        resolve_plan(plan=plan, flags={"seq_len": 512}, ds_config=None, world_size=1, distributed_type="NO")
    with pytest.raises(MemkitError, match=r"--micro-batch-size 8 contradicts the DeepSpeed file"):
        resolve_plan(plan=None, flags={"micro_batch_size": 8}, ds_config=DS_Z2, world_size=2,
                     distributed_type="DEEPSPEED")


def test_world_size_must_match_plan_dp():
    with pytest.raises(MemkitError, match=r"expects 4 data-parallel processes but 2 were launched"):
        resolve_plan(plan=TrainingPlan(dp=4), flags={}, ds_config=None, world_size=2, distributed_type="MULTI_GPU")


def test_zero_plan_without_deepspeed_is_an_error():
    with pytest.raises(MemkitError, match=r"uses ZeRO-2 .* not under DeepSpeed \(MULTI_GPU\)"):
        resolve_plan(plan=TrainingPlan(zero_stage=2, dp=2), flags={}, ds_config=None, world_size=2,
                     distributed_type="MULTI_GPU")
    with pytest.raises(MemkitError, match=r"not FSDP"):
        resolve_plan(plan=None, flags={}, ds_config=None, world_size=2, distributed_type="FSDP")


def test_auto_values_filled_from_plan():
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "zero_optimization": {"stage": 2}}
    plan = resolve_plan(plan=TrainingPlan(zero_stage=2, micro_batch_size=3, grad_accum=2, dp=2, precision="fp32"),
                        flags={}, ds_config=ds, world_size=2, distributed_type="DEEPSPEED")
    assert fill_deepspeed_autos(ds, plan) == ["train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                              "train_batch_size"]
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (3, 2, 12)


# ---- learning rate -----------------------------------------------------------------------------------

def test_lr_schedule_figures():
    kw = dict(peak_lr=1.0, warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [lr_at(s, decay="cosine", **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, decay="cosine", **kw) == 1.0
    assert lr_at(13, decay="cosine", **kw) == pytest.approx(0.1)
    assert lr_at(4 + 9 / 2, decay="cosine", **kw) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert lr_at(13, decay="linear", **kw) == pytest.approx(0.1)
    assert lr_at(9, decay="constant", **kw) == 1.0


def test_scale_lr():
    assert scaled_lr(1e-4, rule="linear", global_batch_size=64, ref_batch_size=16) == \
        (4e-4, "LR scaled linear: 0.0001 x 64 / 16 = 0.0004")
    lr, note = scaled_lr(1e-4, rule="sqrt", global_batch_size=64, ref_batch_size=16)
    assert lr == pytest.approx(2e-4) and note.startswith("LR scaled sqrt: 0.0001 x sqrt(64 / 16)")
    assert scaled_lr(1e-4, rule="none", global_batch_size=64, ref_batch_size=None) == (1e-4, "")
    with pytest.raises(MemkitError, match=r"--scale-lr linear needs --ref-batch-size"):
        scaled_lr(1e-4, rule="linear", global_batch_size=64, ref_batch_size=None)


# ---- loss normalisation ------------------------------------------------------------------------------

def _tiny_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY_LLAMA)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg),
                                            dtype=torch.float32)


def _window_grads(model, data, shard, *, per_micro_mean: bool = False):
    """Gradients of one optimizer step as DeepSpeed/Accelerate form them: each rank's micro-batch
    losses divided by grad_accum and accumulated; then averaged over the dp ranks."""
    from memkit.train.loop import causal_lm_loss_sum, micro_loss_scale

    window = shard.step_indices(0)
    total = int(data.loss_tokens[torch.as_tensor(window.ravel())].sum())
    rank_grads = []
    for rank in range(shard.dp):
        model.zero_grad()
        for micro in shard.rank_micro_batches(0, rank):
            batch = data.batch(micro)
            loss_sum = causal_lm_loss_sum(model(input_ids=batch["input_ids"],
                                                attention_mask=batch["attention_mask"]).logits, batch["labels"])
            if per_micro_mean:  # the common mistake: mean per micro-batch
                n = int((batch["labels"][:, 1:] != -100).sum())
                loss = loss_sum / n
            else:
                loss = loss_sum * micro_loss_scale(grad_accum=shard.grad_accum, dp=shard.dp, window_tokens=total)
            (loss / shard.grad_accum).backward()
        rank_grads.append([p.grad.clone() for p in model.parameters()])
    return [sum(g) / shard.dp for g in zip(*rank_grads)]


def test_accumulation_window_normalisation_matches_one_big_batch():
    from memkit.train.data import Sharding, prepare_data
    from memkit.train.tokenizer import byte_tokenizer

    qa = Path(__file__).resolve().parents[2] / "launch" / "data" / "qa.jsonl"
    data = prepare_data(str(qa), byte_tokenizer(), seq_len=64, max_positions=256, vocab_size=320)
    model = _tiny_model()
    layouts = [Sharding(num_sequences=data.num_sequences, micro_batch_size=m, grad_accum=a, dp=2, seed=0)
               for m, a in ((1, 4), (4, 1), (2, 2))]
    grads = [_window_grads(model, data, s) for s in layouts]
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # The same data with a per-micro-batch mean gives a different update: the test has teeth.
    naive = [_window_grads(model, data, s, per_micro_mean=True) for s in layouts[:2]]
    worst = max(float((a - b).abs().max()) for a, b in zip(*naive))
    assert worst > 1e-4


# ---- LoRA merge --------------------------------------------------------------------------------------

def test_lora_merge_equals_peft_merge_and_unload():
    from peft import LoraConfig, get_peft_model

    from memkit.train.checkpoint import merge_lora_state_dict

    model = get_peft_model(_tiny_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     lora_dropout=0.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    merged = merge_lora_state_dict(model.state_dict(), scaling=8 / 4)
    reference = model.merge_and_unload().state_dict()
    assert sorted(merged) == sorted(reference)
    for key in reference:
        torch.testing.assert_close(merged[key], reference[key], rtol=1e-6, atol=1e-6)


# ---- checkpoints ---------------------------------------------------------------------------------------

def test_latest_skips_unpublished_and_incomplete(tmp_path):
    from memkit.train.checkpoint import STATE_FILE, CheckpointManager, resolve_resume

    root = tmp_path / "checkpoints"
    for name, complete in (("step-00000002", True), (".tmp-step-00000004", True), ("step-00000006", False)):
        (root / name).mkdir(parents=True)
        if complete:  # every file of a one-process Accelerate checkpoint, each loadable as data
            (root / name / STATE_FILE).write_text('{"world_size": 1}')
            torch.save({"torch_manual_seed": torch.get_rng_state()}, root / name / "random_states_0.pkl")
            torch.save({"w": torch.ones(2)}, root / name / "pytorch_model.bin")
    (root / "latest").write_text("step-00000006\n")  # pointer to a folder without its state file
    manager = CheckpointManager(root, accelerator=None)
    assert manager.latest() == root / "step-00000002"
    assert resolve_resume("latest", manager) == root / "step-00000002"
    assert resolve_resume("latest", CheckpointManager(tmp_path / "none", accelerator=None)) is None
    with pytest.raises(MemkitError, match=r"no complete checkpoint there"):
        resolve_resume(str(root / "step-00000006"), manager)


# ---- launch scripts ------------------------------------------------------------------------------------

def _bundle(tmp_path):
    plan = TrainingPlan(precision="fp32", zero_stage=2, micro_batch_size=1, seq_len=64, dp=4)
    _, plan_path = write_bundle(tmp_path, plan, num_gpus_per_node=2, num_nodes=2)
    return plan_path


def test_launch_script_hostfile_and_slurm(tmp_path):
    from memkit.cli.main import main

    plan_path = _bundle(tmp_path)
    hosts = tmp_path / "hosts"
    hosts.write_text("# two nodes\nnode-a slots=2\nnode-b slots=2\n")
    out = tmp_path / "run.sh"
    assert main(["launch-script", "--plan", str(plan_path), "--hostfile", str(hosts), "--out", str(out),
                 "--", "--data", "my data.jsonl", "--output-dir", "out"]) == 0
    text = out.read_text()
    assert "HOSTS=(node-a node-b)" in text and 'MASTER_ADDR="${MEMKIT_MASTER_ADDR:-node-a}"' in text
    assert "--num_machines 2 --num_processes 4" in text and '--machine_rank "$MACHINE_RANK"' in text
    assert "'my data.jsonl'" in text and "--deepspeed_multinode_launcher standard" in text
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
    slurm = tmp_path / "slurm.sh"
    assert main(["launch-script", "--plan", str(plan_path), "--slurm", "--out", str(slurm), "--", "--data",
                 "it's.jsonl"]) == 0
    text = slurm.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=2" in text
    assert '--machine_rank "$SLURM_NODEID"' in text and "memkit-node" in text
    assert subprocess.run(["bash", "-n", str(slurm)]).returncode == 0


def test_launch_script_bad_hostfile(tmp_path, capsys):
    from memkit.cli.main import main

    plan_path = _bundle(tmp_path)
    hosts = tmp_path / "hosts"
    hosts.write_text("only-one slots=2\n")
    assert main(["launch-script", "--plan", str(plan_path), "--hostfile", str(hosts)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"memkit: error: --hostfile {hosts} lists 1 hosts but the plan needs 2 machines; "
                   "list 2 hosts or pass --num-machines"]
    hosts.write_text("a slots=2\nb slots=4\n")
    assert main(["launch-script", "--plan", str(plan_path), "--hostfile", str(hosts)]) == 2
    assert "different slots [2, 4]" in capsys.readouterr().err


def test_verify_picks_next_smaller_alternative():
    from memkit.cli.verify import next_ranked_plan

    doc = {"estimate": {"allocated_peak_bytes": 100},
           "alternatives": [{"label": "bigger", "estimate": {"allocated_peak_bytes": 120}},
                            {"label": "smaller", "estimate": {"allocated_peak_bytes": 80}}]}
    assert next_ranked_plan(doc)["label"] == "smaller"
    assert next_ranked_plan({"estimate": {}, "alternatives": []}) is None


def test_flops_per_token_palm_appendix_b():
    from memkit.measure.runtime import mfu, train_flops_per_token

    # Full fine-tuning: 6N + 12*L*h*s (PaLM App. B). N=1e9, L=16, h=2048, s=2048.
    full = train_flops_per_token(num_params=10**9, num_trainable_params=10**9, num_layers=16,
                                 hidden_size=2048, seq_len=2048)
    assert full == 6e9 + 12 * 16 * 2048 * 2048
    assert mfu(1000.0, full, 100.0) == pytest.approx(1000 * full / 100e12)
    assert mfu(1000.0, full, None) is None
    assert math.isclose(train_flops_per_token(num_params=10**9, num_trainable_params=0, num_layers=0,
                                              hidden_size=0, seq_len=0), 4e9)


def test_memkit_train_dry_run_uses_the_plans_accelerate_config(tmp_path, capsys):
    from memkit.cli.main import main
    from runner_util import TEXT_DATA, write_tiny_llama

    plan = TrainingPlan(precision="fp32", zero_stage=2, micro_batch_size=1, seq_len=64, dp=2)
    config, plan_path = write_bundle(tmp_path / "bundle", plan)
    write_tiny_llama(tmp_path / "tiny")
    assert main(["train", "--plan", str(plan_path), "--model", str(tmp_path / "tiny"), "--data", str(TEXT_DATA),
                 "--output-dir", str(tmp_path / "out"), "--max-steps", "7", "--resume", "--dry-run"]) == 0
    cmd = capsys.readouterr().out.split()
    assert cmd[1:5] == ["-m", "accelerate.commands.launch", "--config_file", str(config)]
    assert cmd[5:7] == ["-m", "memkit.finetune"]  # the module: works from any directory
    args = cmd[7:]
    assert args[args.index("--max-steps") + 1] == "7" and args[args.index("--plan") + 1] == str(plan_path)
    assert "--resume" in args and args[args.index("--output-dir") + 1] == str(tmp_path / "out")


@pytest.mark.parametrize("flags, message", [
    (["--micro-batch-size", "4"], "--micro-batch-size 4 contradicts plan.json (micro_batch_size=2)"),
    (["--seq-len", "512"], "--seq-len 512 contradicts plan.json (seq_len=1024)"),
    (["--lora-targets", "q_proj"], "--lora-targets q_proj contradicts plan.json (lora_targets=('q_proj', 'v_proj'))"),
])
def test_prepare_checks_every_flag_against_the_plan_before_any_rank(tmp_path, flags, message):
    # launched=True as under accelerate launch: the contradiction is found before the model, the
    # data or any process group (finetune prints the one line and exits 2).
    import argparse
    import re

    from memkit.train.main import add_arguments, prepare

    plan = TrainingPlan(micro_batch_size=2, grad_accum=4, seq_len=1024, lora_rank=8)
    (tmp_path / "plan.json").write_text(json.dumps({"model": "llama-3.2-1b", "plan": plan.to_dict()}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--plan", str(tmp_path / "plan.json"), "--data", "synthetic", "--output-dir",
                              str(tmp_path / "out"), *flags])
    with pytest.raises(MemkitError, match=re.escape(f"{message}; drop the flag or make a new plan")):
        prepare(args)
    assert not (tmp_path / "out").exists()  # nothing started


def test_prepare_returns_a_typed_run_description(tmp_path):
    import argparse

    from memkit.train.main import Prepared, add_arguments, prepare

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    # An alias and a hub id resolve as they do for suggest (memkit.spec.resolve, the one resolver).
    args = parser.parse_args(["--model", "llama3.2-1b", "--init", "random", "--data", "synthetic:8", "--output-dir", str(tmp_path),
                              "--seq-len", "64", "--micro-batch-size", "2"])
    prepared = prepare(args, launched=False)
    assert isinstance(prepared, Prepared) and prepared.plan is None
    assert prepared.source.name == "llama-3.2-1b" and prepared.source.hub_id == "meta-llama/Llama-3.2-1B"
    assert prepared.flags["micro_batch_size"] == 2 and prepared.flags["seq_len"] == 64
    assert prepared.model_config.vocab_size == 128256
    args.model = "meta-llama/Llama-3.2-1B"
    assert prepare(args, launched=False).source.config_path == prepared.source.config_path


def test_manifest_names_damage_and_falls_back(tmp_path, capsys):
    """Single process (accelerator None): the manifest is verified, RNG states included; the damaged
    newest checkpoint is named in one line and the older intact one is resumed (and said)."""
    from memkit.train.checkpoint import CheckpointManager, resolve_resume, write_manifest

    root = tmp_path / "checkpoints"
    for step in (1, 2):
        folder = root / f"step-{step:08d}"
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
        torch.save({"torch_manual_seed": torch.get_rng_state()}, folder / "random_states_0.pkl")
        (folder / "pytorch_model").mkdir()
        torch.save({"module": {"w": torch.ones(250)}}, folder / "pytorch_model" / "mp_rank_00_model_states.pt")
        write_manifest(folder, step=step, accelerator=None)
    (root / "latest").write_text("step-00000002\n")
    manager = CheckpointManager(root, accelerator=None)
    assert resolve_resume("latest", manager) == root / "step-00000002"
    rng = root / "step-00000002" / "random_states_0.pkl"
    size = rng.stat().st_size
    rng.write_bytes(rng.read_bytes()[:50])  # truncated RNG states: Accelerate alone would skip them silently
    capsys.readouterr()
    assert resolve_resume("latest", manager) == root / "step-00000001"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert f"step-00000002 is damaged: random_states_0.pkl is 50 bytes, the manifest says {size}" in err[0]
    assert "resuming from step-00000001" in err[1]
    with pytest.raises(MemkitError, match=r"random_states_0.pkl is 50 bytes"):
        resolve_resume(str(root / "step-00000002"), manager)
    same_size = root / "step-00000001" / "pytorch_model" / "mp_rank_00_model_states.pt"
    same_size.write_bytes(b"x" * same_size.stat().st_size)  # same size, other bytes: the SHA-256 catches it
    with pytest.raises(MemkitError, match=r"every checkpoint .* is damaged"):
        resolve_resume("latest", manager)


# ---- the start record's versions -------------------------------------------------------------------

_VERSIONS_PROBE = """
import sys
from memkit.train.loop import _versions
without = _versions()
assert "deepspeed" not in sys.modules, "a run without DeepSpeed imported it to name its version"
import deepspeed
assert without == _versions(), (without, _versions())
assert without["deepspeed"] == deepspeed.__version__
print("ok")
"""


@pytest.mark.slow  # imports torch, transformers, accelerate and deepspeed in a fresh process: 6.0 CPU s measured
def test_versions_name_deepspeed_without_importing_it_and_say_what_its_import_says():
    """memkit.train.loop._versions in a rank that never imported DeepSpeed (a torch-engine run)
    reads the installed package's version: the same record as after `import deepspeed`."""
    proc = subprocess.run([sys.executable, "-c", _VERSIONS_PROBE], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
