"""`memkit estimate`: the JSON contract and one-line errors with exit code 2."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memkit.cli.main import main

BASE = ["estimate", "--model", "llama-3.1-8b", "--gpu", "a100-80gb", "--num-gpus", "8",
        "--micro-batch-size", "2", "--seq-len", "4096", "--precision", "bf16", "--optimizer", "adamw",
        "--zero", "2", "--checkpointing", "full", "--attention", "sdpa"]
REQUIRED_KEYS = {"allocated_peak_bytes", "reserved_peak_bytes", "device_total_bytes", "num_params",
                 "num_trainable_params", "peak_phase", "components", "host_bytes_per_node"}


def run_cli(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_has_the_contract_keys(capsys):
    code, out, _ = run_cli(BASE + ["--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert REQUIRED_KEYS <= set(data)
    assert data["num_params"] == 8_030_261_248 == data["num_trainable_params"]
    assert data["device_total_bytes"] == 80 * 1024**3
    assert data["peak_phase"] in data["phases"]
    assert sum(data["components"].values()) == data["allocated_peak_bytes"]
    assert data["allocated_peak_bytes"] < data["reserved_peak_bytes"] < data["nvidia_smi_peak_bytes"]


def test_table_names_the_peak_phase_and_headroom(capsys):
    code, out, _ = run_cli(BASE, capsys)
    assert code == 0
    assert "allocated peak" in out and "phase: " in out and "headroom" in out and "weights" in out


def test_lora_counts_trainable_params_exactly(capsys):
    code, out, _ = run_cli(BASE + ["--lora-rank", "16", "--json"], capsys)
    data = json.loads(out)
    # q_proj 4096x4096 and v_proj 4096x1024 per layer: r*(in+out) each, 32 layers.
    assert data["num_trainable_params"] == 32 * 16 * ((4096 + 4096) + (4096 + 1024))


@pytest.mark.parametrize("args, message", [
    (["--model", "llama-3.1-8", "--gpu", "a100-80gb"], r"unknown model .*did you mean.*llama-3.1-8b"),
    (["--model", "llama-3.1-8b", "--gpu", "a100-81gb"], r"unknown GPU 'a100-81gb' \(did you mean"),
    (["--model", "llama-3.1-8b", "--gpu", "a100-80gb", "--num-gpus", "3", "--tp", "3"],
     r"tp=3 does not divide num_attention_heads=32.*try tp in \{1,2,4,8\}"),
    (["--model", "llama-3.1-8b", "--gpu", "v100-16gb", "--precision", "bf16"],
     r"v100-16gb has no bf16 support; use --precision fp16 or fp32"),
    (["--model", "llama-3.1-8b", "--gpu", "t4", "--precision", "bf16-pure"], r"t4 has no bf16 support"),
    (["--model", "llama-3.1-8b", "--gpu", "a100-80gb", "--micro-batch-size", "-2"],
     r"--micro-batch-size -2 must be a positive integer"),
    (["--model", "llama-3.1-8b", "--gpu", "a100-80gb", "--seq-len", "0"], r"--seq-len 0 must be a positive"),
    (["--model", "llama-3.1-8b", "--gpu-memory", "lots"], r"--gpu-memory 'lots' is not a size"),
    (["--model", "llama-3.1-8b", "--gpu", "a100-80gb", "--zero", "0", "--offload-optimizer", "cpu"],
     r"--offload-optimizer cpu needs ZeRO"),
    (["--model", "llama-3.1-8b", "--gpu", "a100-80gb", "--pp", "64", "--num-gpus", "64"],
     r"pp=64 exceeds the model's 32 layers"),
    (["--model", "llama-3.1-8b", "--gpu", "a100-80gb", "--num-gpus", "2", "--num-nodes", "2", "--tp", "4"],
     r"tp=4 spans nodes"),
])
def test_bad_input_is_one_line_exit_2(args, message, capsys):
    code, _, err = run_cli(["estimate"] + args, capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("memkit: error: ")
    assert pytest.importorskip("re").search(message, err), err


def test_malformed_config_json(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": 64,,}')
    code, _, err = run_cli(["estimate", "--model", str(bad), "--gpu", "a100-80gb"], capsys)
    assert code == 2 and "config.json" in err and err.count("\n") == 1


def test_console_script_exits_2_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "memkit.cli.main", "estimate", "--model", "nope",
                           "--gpu", "a100-80gb"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("memkit: error: unknown model")


def test_device_cpu_prices_the_cpu_run_and_traced_models_say_so(capsys, tmp_path):
    """--device cpu: no CUDA context or allocator cache (reserved == allocated == nvidia-smi), device
    memory = host RAM without --gpu; a model type hf.py does not model is traced, and says so."""
    config = {"model_type": "olmo2", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 2000}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, _ = run_cli(["estimate", "--model", str(tmp_path), "--device", "cpu", "--engine", "torch",
                            "--micro-batch-size", "2", "--seq-len", "256", "--precision", "bf16", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["device"] == "cpu"
    assert data["allocated_peak_bytes"] == data["reserved_peak_bytes"] == data["nvidia_smi_peak_bytes"]
    assert data["device_total_bytes"] == 64 * 1024**3
    assert any("traced from the transformers olmo2 module" in a for a in data["approximations"])
    cuda = json.loads(run_cli(["estimate", "--model", str(tmp_path), "--gpu", "a100-80gb", "--engine", "torch",
                               "--micro-batch-size", "2", "--seq-len", "256", "--precision", "bf16", "--json"],
                              capsys)[1])
    assert cuda["reserved_peak_bytes"] > cuda["allocated_peak_bytes"]
