"""Emitted files are accepted by the installed DeepSpeed, Accelerate and transformers themselves,
say each setting once, and match the golden copies under tests/golden/emit/.

The acceptance checks run in one subprocess (a gloo process group of one rank, so that
DeepSpeed's config parser sees a distributed world; the data-parallel size comes from an `mpu`,
DeepSpeed's own hook for it) so this pytest process never initialises torch.distributed.
Regenerate the golden copies with: MEMKIT_UPDATE_GOLDEN=1 pytest tests/unit/test_emit.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memkit.emit.accelerate import accelerate_config
from memkit.emit.bundle import FILES, bundle_files, plan_document, write_bundle
from memkit.emit.deepspeed import batch_fields, deepspeed_config
from memkit.emit.trainer import trainer_arguments
from memkit.errors import MemkitError
from memkit.plan.plan import TrainingPlan

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "emit"
MODEL = "qwen2.5-0.5b"

# name -> (plan knobs, GPUs per node, nodes)
CASES = {
    "z0-bf16-1gpu": (dict(zero_stage=0, precision="bf16"), 1, 1),
    "z0-fp16-2gpu": (dict(zero_stage=0, precision="fp16"), 2, 1),
    "z0-fp32-1gpu": (dict(zero_stage=0, precision="fp32", checkpointing="full"), 1, 1),
    "z1-bf16-offload-4gpu": (dict(zero_stage=1, offload_optimizer="cpu", overlap_comm=True), 4, 1),
    "z1-bf16-sgd-2gpu": (dict(zero_stage=1, optimizer="sgd"), 2, 1),
    "z2-fp16-2gpu": (dict(zero_stage=2, precision="fp16", overlap_comm=False), 2, 1),
    "z2-bf16-offload-2x4gpu": (dict(zero_stage=2, offload_optimizer="cpu", overlap_comm=True), 4, 2),
    "z2-bf16-adafactor-2gpu": (dict(zero_stage=2, optimizer="adafactor"), 2, 1),
    "z2-bf16-adamw8bit-2gpu": (dict(zero_stage=2, optimizer="adamw-8bit"), 2, 1),
    "z2-bf16-lora-2gpu": (dict(zero_stage=2, lora_rank=16), 2, 1),
    "z3-bf16-2gpu": (dict(zero_stage=3, overlap_comm=True, reduce_bucket_size=802816,
                          stage3_prefetch_bucket_size=722534, stage3_param_persistence_threshold=8960,
                          stage3_max_live_parameters=50_000_000, stage3_max_reuse_distance=50_000_000), 2, 1),
    "z3-bf16-offload-all-1gpu": (dict(zero_stage=3, offload_optimizer="cpu", offload_params="cpu",
                                      checkpointing="full"), 1, 1),
    "z3-fp16-nvme-2gpu": (dict(zero_stage=3, precision="fp16", offload_optimizer="nvme", offload_params="nvme"), 2, 1),
    "z3-bf16pure-2gpu": (dict(zero_stage=3, precision="bf16-pure"), 2, 1),
    "z1-bf16-tp2-4gpu": (dict(zero_stage=1, tp=2), 4, 1),
    "z0-bf16-pp2-2gpu": (dict(zero_stage=0, pp=2, engine="torch"), 2, 1),
}
DS_CASES = [name for name, (knobs, _, _) in CASES.items() if knobs.get("engine", "deepspeed") == "deepspeed"]
TORCH_CASES = [name for name in CASES if name not in DS_CASES]


def _plan(name: str) -> tuple[TrainingPlan, int, int]:
    knobs, per_node, nodes = CASES[name]
    gpus = per_node * nodes
    split = knobs.get("tp", 1) * knobs.get("pp", 1)
    plan = TrainingPlan(micro_batch_size=2, grad_accum=3, seq_len=1024, dp=gpus // split, **knobs).validate()
    return plan, per_node, nodes


def _document(plan: TrainingPlan, per_node: int, nodes: int) -> dict:
    from memkit.estimate.memory import estimate_memory
    from memkit.estimate.throughput import estimate_step_time
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import load_model_spec

    model = load_model_spec(MODEL)
    hardware = Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=per_node, num_nodes=nodes)
    hw = {"gpu": "a100-80gb", "gpu_memory_bytes": hardware.gpu.memory_bytes, "num_gpus_per_node": per_node,
          "num_nodes": nodes, "host_ram_bytes_per_node": hardware.host_ram_bytes_per_node}
    return plan_document(model_name=MODEL, plan=plan, hardware=hw,
                         memory=estimate_memory(model, plan, hardware),
                         speed=estimate_step_time(model, plan, hardware), label=name_of(plan),
                         version_info={"memkit": "test"})


def name_of(plan: TrainingPlan) -> str:
    from memkit.planner.space import describe

    return describe(plan)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bundles")
    out = {}
    for name in CASES:
        plan, per_node, nodes = _plan(name)
        folder = root / name
        files = bundle_files(_document(plan, per_node, nodes), out_dir=str(folder), nvme_path=str(root / "nvme"),
                             largest_param_numel=151_936 * 896, main_process_ip="10.0.0.1")
        write_bundle(str(folder), files)
        out[name] = folder
    return out


@pytest.fixture(scope="module")
def accepted(bundles) -> dict[str, dict]:
    """Each bundle through DeepSpeed's, Accelerate's and transformers' own parsers (one subprocess)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, __file__, *map(str, bundles.values())], capture_output=True,
                          text=True, timeout=600, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {Path(r["dir"]).name: r for r in map(json.loads, lines)}


@pytest.mark.parametrize("name", DS_CASES)
def test_deepspeed_parses_the_config_with_the_plan_batch(name, accepted):
    plan, _, _ = _plan(name)
    result = accepted[name]
    assert result["deepspeed"] == "ok", result["deepspeed"]
    # What DeepSpeed counts as data ranks without an mpu: every process, dp x tp (see the checker).
    assert result["ds_world_size"] == plan.dp * plan.tp
    assert result["ds_train_batch_size"] == plan.micro_batch_size * plan.grad_accum * plan.dp * plan.tp
    assert result["ds_zero_stage"] == plan.zero_stage
    assert result["ds_offload_optimizer"] == plan.offload_optimizer
    assert result["ds_offload_param"] == plan.offload_params


def test_autotp_batch_counts_every_process():
    """micro 2 x accum 3 x dp 2 x tp 2 = 24; the data-parallel-only count (12) is what DeepSpeed
    rejects at startup under AutoTP (the checker's ds_rejects_dp_world shows it does)."""
    plan = _plan("z1-bf16-tp2-4gpu")[0]
    assert (plan.dp, plan.tp, plan.global_batch_size) == (2, 2, 12)
    assert deepspeed_config(plan)["train_batch_size"] == batch_fields(plan)["train_batch_size"] == 24
    assert deepspeed_config(plan)["tensor_parallel"] == {"autotp_size": 2}


def test_deepspeed_refuses_the_data_parallel_only_batch_under_autotp(accepted):
    assert accepted["z1-bf16-tp2-4gpu"]["ds_rejects_dp_world"].startswith("AssertionError: Check batch related")


@pytest.mark.parametrize("name", DS_CASES)
def test_accelerate_loads_the_yaml_and_launch_accepts_it(name, accepted):
    plan, per_node, nodes = _plan(name)
    result = accepted[name]
    assert result["accelerate"] == "ok", result["accelerate"]
    assert result["distributed_type"] == "DEEPSPEED"
    assert result["num_processes"] == per_node * nodes and result["num_machines"] == nodes
    # Accelerate takes mixed precision from the DeepSpeed file, not from the YAML.
    assert result["mixed_precision_from_yaml"] is False
    expected = {"fp16": "fp16", "bf16": "bf16", "bf16-pure": "bf16", "fp32": "no"}[plan.precision]
    assert result["effective_mixed_precision"] == expected


@pytest.mark.parametrize("name", TORCH_CASES)
def test_pipeline_bundle_is_a_plain_multi_process_launch(name, accepted, bundles):
    plan, per_node, nodes = _plan(name)
    result = accepted[name]
    assert not (bundles[name] / "ds_config.json").exists()
    assert result["deepspeed"] == "no DeepSpeed file" and result["accelerate"] == "ok", result
    # accelerate launch starts it through torchrun (multi_gpu_launcher), not DeepSpeed.
    assert result["distributed_type"] == "MULTI_GPU" and result["launcher_multi_gpu"] is True
    assert result["launcher_use_deepspeed"] is False
    assert result["num_processes"] == per_node * nodes == plan.num_gpus
    expected = {"bf16": "bf16", "fp32": "no", "bf16-pure": "no"}[plan.precision]
    assert result["mixed_precision_from_yaml"] is True and result["effective_mixed_precision"] == expected
    doc = json.loads((bundles[name] / "plan.json").read_text())
    assert doc["engines"]["pipeline_parallel"].startswith("torch.distributed.pipelining, 2 stages, Schedule1F1B")
    assert doc["engines"]["tensor_parallel"] is None and "no DeepSpeed" in doc["engines"]["launcher"]
    with pytest.raises(MemkitError, match="does not run under DeepSpeed"):
        deepspeed_config(plan)


@pytest.mark.parametrize("name", DS_CASES)
def test_hf_trainer_takes_the_same_json(name, accepted):
    plan, _, _ = _plan(name)
    result = accepted[name]
    assert result["hf_deepspeed_config"] == "ok", result["hf_deepspeed_config"]
    # One process here: Trainer computes train_batch_size with world size 1, so a plan for several
    # ranks differs exactly there and nowhere else.
    ds_batch = batch_fields(plan)["train_batch_size"]
    expected = [] if ds_batch == plan.micro_batch_size * plan.grad_accum else [
        f"- ds train_batch_size={ds_batch} vs hf train_batch_size (calculated)="
        f"{plan.micro_batch_size * plan.grad_accum}"]
    assert result["trainer_mismatches"] == expected
    assert result["trainer_zero3"] == (plan.zero_stage == 3)


@pytest.mark.parametrize("name", DS_CASES)
def test_no_auto_values_and_integer_buckets(name, bundles):
    ds = json.loads((bundles[name] / "ds_config.json").read_text())

    def walk(node, path=""):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from walk(v, f"{path}.{k}")
        else:
            yield path, node
    for path, value in walk(ds):
        assert value != "auto", path
        if path.endswith(("bucket_size", "_parameters", "_distance", "_threshold", "buffer_size")):
            assert isinstance(value, int) and not isinstance(value, bool), (path, value)


@pytest.mark.parametrize("name", list(CASES))
def test_each_setting_lives_in_one_file(name, bundles):
    acc = yaml.safe_load((bundles[name] / "accelerate.yaml").read_text())
    if name in TORCH_CASES:  # no DeepSpeed file: the YAML is the one place mixed precision is set
        assert "deepspeed_config" not in acc and acc["mixed_precision"] in ("no", "bf16")
        return
    assert "mixed_precision" not in acc
    assert set(acc["deepspeed_config"]) <= {"deepspeed_config_file", "zero3_init_flag",
                                            "deepspeed_multinode_launcher"}
    assert acc["deepspeed_config"]["deepspeed_config_file"] == f"{bundles[name]}/ds_config.json"


@pytest.mark.parametrize("name", list(CASES))
def test_golden_files(name, bundles):
    for fname in ("ds_config.json", "accelerate.yaml") if name in DS_CASES else ("accelerate.yaml",):
        text = (bundles[name] / fname).read_text().replace(str(bundles[name].parent), "BUNDLES")
        golden = GOLDEN / name / fname
        if os.environ.get("MEMKIT_UPDATE_GOLDEN"):
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(text)
        assert golden.is_file(), f"missing {golden}; run MEMKIT_UPDATE_GOLDEN=1 pytest {__file__}"
        assert text == golden.read_text(), f"{golden} differs; regenerate if the change is intended"


def test_bundle_has_its_four_files_and_plan_json_contract(bundles):
    folder = bundles["z3-bf16-2gpu"]
    assert sorted(p.name for p in folder.iterdir()) == sorted(FILES)
    doc = json.loads((folder / "plan.json").read_text())
    assert doc["model"] == MODEL and doc["hardware"]["num_gpus_per_node"] == 2
    assert TrainingPlan.from_dict(doc["plan"]) == _plan("z3-bf16-2gpu")[0]
    assert {"allocated_peak_bytes", "reserved_peak_bytes", "nvidia_smi_peak_bytes"} <= set(doc["estimate"])
    assert {"tokens_per_s", "step_time_s", "mfu"} <= set(doc["step_time"])
    readme = (folder / "README.md").read_text()
    command = f"accelerate launch --config_file {folder}/accelerate.yaml -m memkit.finetune --plan {folder}/plan.json"
    assert command in readme
    assert doc["engines"] == {"launcher": "accelerate launch, DeepSpeed (ds_config.json)",
                              "data_parallel": "DeepSpeed ZeRO-3", "tensor_parallel": None, "pipeline_parallel": None}
    pp = bundles["z0-bf16-pp2-2gpu"]
    assert sorted(p.name for p in pp.iterdir()) == sorted(f for f in FILES if f != "ds_config.json")
    assert "ds_config.json" not in (pp / "README.md").read_text()


def test_dynamic_loss_scaling_under_fp16():
    ds = deepspeed_config(_plan("z2-fp16-2gpu")[0])
    assert ds["fp16"]["enabled"] is True and ds["fp16"]["loss_scale"] == 0  # 0 = dynamic
    assert "bf16" not in ds


def test_cpu_offload_keeps_adamw_in_the_config_so_deepspeed_uses_cpu_adam():
    ds = deepspeed_config(_plan("z1-bf16-offload-4gpu")[0], lr=3e-4, weight_decay=0.1)
    assert ds["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                          "weight_decay": 0.1}}
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


def test_client_optimizers_are_allowed_not_configured():
    for name in ("z2-bf16-adafactor-2gpu", "z2-bf16-adamw8bit-2gpu"):
        ds = deepspeed_config(_plan(name)[0])
        assert "optimizer" not in ds and ds["zero_allow_untested_optimizer"] is True
    assert "optimizer" not in deepspeed_config(_plan("z0-bf16-1gpu")[0], optimizer_block=False)


def test_trainer_arguments_match_the_config():
    plan = _plan("z2-fp16-2gpu")[0]
    args = trainer_arguments(plan, lr=1e-4)
    assert args["per_device_train_batch_size"] == 2 and args["gradient_accumulation_steps"] == 3
    assert args["fp16"] is True and args["bf16"] is False and args["learning_rate"] == 1e-4


def test_bf16_pure_needs_zero():
    with pytest.raises(MemkitError, match="bf16-pure under DeepSpeed needs ZeRO 1-3"):
        deepspeed_config(TrainingPlan(precision="bf16-pure", zero_stage=0))


def test_accelerate_refuses_a_hardware_mismatch():
    with pytest.raises(ValueError, match="plan uses dp\\*tp\\*pp=2 GPUs but the hardware has 4"):
        accelerate_config(TrainingPlan(dp=2), deepspeed_config_file="x.json", num_gpus_per_node=4)


# ---- the checker, run as a subprocess by the `accepted` fixture ---------------------------------

def _check_bundle(folder: Path) -> dict:
    from deepspeed.runtime.config import DeepSpeedConfig

    result: dict = {"dir": str(folder)}
    ds_path = folder / "ds_config.json"
    yaml_path = folder / "accelerate.yaml"
    plan = TrainingPlan.from_dict(json.loads((folder / "plan.json").read_text())["plan"])
    if not ds_path.exists():  # a pipeline plan: a plain multi-process launch, nothing for DeepSpeed
        result.update(deepspeed="no DeepSpeed file", hf_deepspeed_config="no DeepSpeed file")
        try:
            result.update(_check_accelerate_plain(yaml_path))
            result["accelerate"] = "ok"
        except Exception as exc:
            result["accelerate"] = f"{type(exc).__name__}: {exc}"
        return result

    class DataParallelUnit:  # DeepSpeed's `mpu` interface: the ranks its batch check counts
        def __init__(self, size):
            self.size = size

        def get_data_parallel_world_size(self):
            return self.size

        def get_data_parallel_rank(self):
            return 0

        def get_model_parallel_world_size(self):
            return 1

        def get_model_parallel_rank(self):
            return 0

    # At run time neither Accelerate nor memkit's runner passes an mpu, so DeepSpeed counts
    # dist.get_world_size() = dp x tp processes (deepspeed/runtime/config.py, DeepSpeedConfig).
    world = plan.dp * plan.tp
    try:
        cfg = DeepSpeedConfig(json.loads(ds_path.read_text()), mpu=DataParallelUnit(world))
        zero = cfg.zero_config

        def device(block):
            return "none" if block is None else str(getattr(block.device, "value", block.device))
        result.update(deepspeed="ok", ds_world_size=cfg.world_size, ds_train_batch_size=cfg.train_batch_size,
                      ds_zero_stage=int(zero.stage), ds_offload_optimizer=device(zero.offload_optimizer),
                      ds_offload_param=device(zero.offload_param))
    except Exception as exc:  # report, the test asserts
        result["deepspeed"] = f"{type(exc).__name__}: {exc}"
    if plan.tp > 1:  # the data-parallel-only count is what DeepSpeed refuses under AutoTP
        try:
            DeepSpeedConfig(json.loads(ds_path.read_text()), mpu=DataParallelUnit(plan.dp))
            result["ds_rejects_dp_world"] = "accepted"
        except Exception as exc:
            result["ds_rejects_dp_world"] = f"{type(exc).__name__}: {exc}"
    try:
        result.update(_check_accelerate(yaml_path, ds_path))
        result["accelerate"] = "ok"
    except Exception as exc:
        result["accelerate"] = f"{type(exc).__name__}: {exc}"
    try:
        result.update(_check_transformers(ds_path, plan))
        result["hf_deepspeed_config"] = "ok"
    except Exception as exc:
        result["hf_deepspeed_config"] = f"{type(exc).__name__}: {exc}"
    return result


def _check_accelerate(yaml_path: Path, ds_path: Path) -> dict:
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin

    cfg = load_config_from_file(str(yaml_path))
    args = launch_command_parser().parse_args(["--config_file", str(yaml_path), "train.py"])
    args, defaults, mp_from_yaml = _validate_launch_command(args)
    # What `accelerate launch` hands the processes (commands/launch.py, launch_command): the YAML's
    # DeepSpeed keys; DeepSpeedPlugin refuses any that the JSON owns.
    fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_yaml else [])
    os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(fields).lower()
    plugin = DeepSpeedPlugin(hf_ds_config=str(ds_path))
    plugin.set_mixed_precision(args.mixed_precision)
    config = plugin.deepspeed_config
    effective = "fp16" if config.get("fp16", {}).get("enabled") else (
        "bf16" if config.get("bf16", {}).get("enabled") else "no")
    return {"distributed_type": cfg.distributed_type.value, "num_processes": cfg.num_processes,
            "num_machines": cfg.num_machines, "mixed_precision_from_yaml": bool(mp_from_yaml),
            "effective_mixed_precision": effective}


def _check_accelerate_plain(yaml_path: Path) -> dict:
    """What `accelerate launch --config_file` makes of a non-DeepSpeed YAML (commands/launch.py)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    cfg = load_config_from_file(str(yaml_path))
    args = launch_command_parser().parse_args(["--config_file", str(yaml_path), "train.py"])
    args, _, mp_from_yaml = _validate_launch_command(args)
    return {"distributed_type": cfg.distributed_type.value, "num_processes": args.num_processes,
            "num_machines": args.num_machines, "launcher_multi_gpu": bool(args.multi_gpu),
            "launcher_use_deepspeed": bool(args.use_deepspeed), "mixed_precision_from_yaml": bool(mp_from_yaml),
            "effective_mixed_precision": args.mixed_precision}


def _check_transformers(ds_path: Path, plan: TrainingPlan) -> dict:
    from transformers import TrainingArguments
    from transformers.integrations import HfDeepSpeedConfig

    HfDeepSpeedConfig(str(ds_path))
    args = TrainingArguments(output_dir=str(ds_path.parent / "trainer"), deepspeed=str(ds_path), report_to=[],
                             use_cpu=True, **trainer_arguments(plan))
    hf = args.hf_deepspeed_config
    mismatches = list(hf.mismatches)
    if plan.dp == 1:
        hf.trainer_config_finalize(args, None, 10)  # raises on any mismatch
    return {"trainer_mismatches": mismatches, "trainer_zero3": hf.is_zero3()}


def _main(folders: list[str]) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1"})
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    try:
        for folder in folders:
            print(json.dumps(_check_bundle(Path(folder))), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1:])
