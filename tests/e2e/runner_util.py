"""Shared pieces of the runner's end-to-end tests: a tiny Llama, config files from memkit.emit,
and `accelerate launch` of launch/finetune.py with a timeout."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from memkit.emit.accelerate import accelerate_config
from memkit.emit.deepspeed import deepspeed_config
from memkit.plan.plan import TrainingPlan

REPO = Path(__file__).resolve().parents[2]
FINETUNE = REPO / "launch" / "finetune.py"
TEXT_DATA = REPO / "launch" / "data" / "text.jsonl"
QA_DATA = REPO / "launch" / "data" / "qa.jsonl"

TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def write_tiny_llama(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return path


def write_bundle(folder: Path, plan: TrainingPlan, *, num_gpus_per_node: int = 2, num_nodes: int = 1,
                 lr: float = 1e-3) -> tuple[Path, Path]:
    """accelerate.yaml + ds_config.json as memkit.emit writes them; returns (yaml, plan.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    ds_path = folder / "ds_config.json"
    ds_path.write_text(json.dumps(deepspeed_config(plan, lr=lr), indent=1))
    acc = accelerate_config(plan, deepspeed_config_file=str(ds_path), num_gpus_per_node=num_gpus_per_node,
                            num_nodes=num_nodes)
    yaml_path = folder / "accelerate.yaml"
    yaml_path.write_text(yaml.safe_dump(acc, sort_keys=False))
    plan_path = folder / "plan.json"
    plan_path.write_text(json.dumps(plan_document(plan, num_gpus_per_node=num_gpus_per_node,
                                                  num_nodes=num_nodes), indent=1))
    return yaml_path, plan_path


def plan_document(plan: TrainingPlan, *, num_gpus_per_node: int, num_nodes: int, model: str = "tiny-llama",
                  config_path: Path | None = None) -> dict:
    """plan.json as `memkit suggest --out` writes it, with memkit's estimate priced for the CPU
    (estimate_memory(device="cpu")), which the runs' live-tensor peaks are compared with."""
    from memkit.emit.bundle import plan_document as make_document
    from memkit.estimate.memory import estimate_memory
    from memkit.estimate.throughput import estimate_step_time
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import spec_from_config

    spec = spec_from_config(dict(TINY_LLAMA), name=model)
    hardware = Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=num_gpus_per_node, num_nodes=num_nodes)
    hw = {"gpu": hardware.gpu.name, "num_gpus_per_node": num_gpus_per_node, "num_nodes": num_nodes}
    return make_document(model_name=model, plan=plan, hardware=hw,
                         memory=estimate_memory(spec, plan, hardware, device="cpu"),
                         speed=estimate_step_time(spec, plan, hardware), label="test")


def env() -> dict:
    out = dict(os.environ)
    out.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
                "ACCELERATE_DISABLE_RICH": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
    return out


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(config_file: Path, args: list[str], *, timeout_s: int = 900, extra_launch: list[str] = ()) \
        -> subprocess.CompletedProcess:
    """accelerate launch CONFIG launch/finetune.py ARGS; the whole process group dies on timeout.
    The timeout is a hang guard only (a run here takes ~15-50 s; DeepSpeed's ops are built before
    the session by tests/conftest.py), never a pass/fail margin."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file),
           "--main_process_port", str(free_port()), *extra_launch, str(FINETUNE), "--no-progress", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGUSR2)  # finetune dumps its threads' stacks (faulthandler)
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            pass
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout_s}s: {' '.join(cmd)}\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def read_log(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "log.jsonl").read_text().splitlines()]


def events(log: list[dict], name: str) -> list[dict]:
    return [r for r in log if r["event"] == name]


def final_params(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def once(tmp_path_factory, key: str, make) -> Path:
    """Build a folder once per test session, also across pytest-xdist workers, and return it: the
    workers of one session share the parent of their base temp folders, and a file lock lets the
    first worker build while the others wait, then read (the pattern in pytest-xdist's docs, "Making
    session-scoped fixtures execute only once"). A failed build leaves no "done" mark, so the next
    reader builds again and fails the same way, loudly."""
    import os
    import shutil

    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # .../pytest-N/popen-gwK: pytest-N is this session's, shared
        base = base.parent
    root = base / "shared-runs"
    root.mkdir(exist_ok=True)
    folder, done = root / key, root / f"{key}.done"
    with FileLock(str(root / f"{key}.lock")):
        if not done.exists():
            if folder.exists():
                shutil.rmtree(folder)  # a build that failed earlier in this session
            folder.mkdir()
            make(folder)
            done.write_text("ok\n")
    return folder
