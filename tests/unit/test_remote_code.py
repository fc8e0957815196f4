"""Models whose code ships with the checkpoint (issue 20 item 4): priced without running that code by
default, through its own code only under --trust-remote-code.

- Qwen-1 (model_type 'qwen', QWenLMHeadModel) is mapped: its parameter count is the formula hand-worked
  from Qwen/Qwen-7B modeling_qwen.py (QWenAttention, QWenMLP, QWenBlock, QWenModel, QWenLMHeadModel),
  on configs in the public config.json shape; the output says in one line what it is priced as and why.
- The same count comes out of a real build of a Qwen-1-shaped model folder (configuration/modeling files
  written here, loaded by transformers' dynamic-module loader) under --trust-remote-code, which traces it.
- A remote-code config memkit has no mapping for is one line and exit 2, naming the fix.
"""
from __future__ import annotations

import json

import pytest

from memkit.cli.main import main
from memkit.errors import MemkitError
from memkit.plan.plan import TrainingPlan
from memkit.spec.hf import load_model_spec, spec_from_config

# Qwen/Qwen-7B config.json as published (huggingface.co/Qwen/Qwen-7B), the keys its code reads.
QWEN_7B = {"architectures": ["QWenLMHeadModel"], "auto_map": {
    "AutoConfig": "configuration_qwen.QWenConfig", "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
    "attn_dropout_prob": 0.0, "bf16": False, "emb_dropout_prob": 0.0, "fp16": False, "fp32": False,
    "hidden_size": 4096, "intermediate_size": 22016, "initializer_range": 0.02, "kv_channels": 128,
    "layer_norm_epsilon": 1e-06, "max_position_embeddings": 8192, "model_type": "qwen", "no_bias": True,
    "num_attention_heads": 32, "num_hidden_layers": 32, "onnx_safe": None, "rotary_emb_base": 10000,
    "rotary_pct": 1.0, "scale_attn_weights": True, "seq_length": 8192, "tie_word_embeddings": False,
    "tokenizer_class": "QWenTokenizer", "transformers_version": "4.32.0", "use_cache": True,
    "use_dynamic_ntk": True, "use_flash_attn": "auto", "use_logn_attn": True, "vocab_size": 151936}


def qwen1_params(h: int, layers: int, inter: int, vocab: int, *, no_bias: bool = True) -> int:
    """Hand-worked from modeling_qwen.py: per block ln_1 + ln_2 (RMSNorm weight, H each), c_attn
    Linear(H, 3H) with bias, c_proj Linear(H, H, bias=not no_bias); QWenMLP w1, w2 Linear(H, I/2) and
    c_proj Linear(I/2, H), bias=not no_bias; wte (V x H), ln_f (H), lm_head Linear(H, V, bias=False)."""
    half, b = inter // 2, 0 if no_bias else 1
    block = 2 * h + (h * 3 * h + 3 * h) + (h * h + b * h) + 2 * (h * half + b * half) + (half * h + b * h)
    return vocab * h + layers * block + h + vocab * h


def test_qwen1_is_priced_as_its_mapping_with_the_published_counts():
    spec = spec_from_config(QWEN_7B, name="qwen-7b")
    assert spec.num_params == qwen1_params(4096, 32, 22016, 151936) == 7_721_324_544  # "Qwen-7B": 7.7B
    assert not spec.traced and spec.architecture == "QWenLMHeadModel" and spec.intermediate_size == 11008
    [line] = spec.approximations
    assert line.startswith("priced as a Llama-style decoder") and "because model_type 'qwen'" in line
    assert "--trust-remote-code" in line and "\n" not in line
    # Qwen-1.8B's sizes (huggingface.co/Qwen/Qwen-1_8B config.json): 1.84B
    small = {**QWEN_7B, "hidden_size": 2048, "num_attention_heads": 16, "num_hidden_layers": 24,
             "intermediate_size": 11008}
    assert spec_from_config(small, name="qwen-1.8b").num_params == qwen1_params(2048, 24, 11008, 151936) \
        == 1_836_828_672
    biased = {**small, "no_bias": False}
    assert spec_from_config(biased, name="b").num_params == qwen1_params(2048, 24, 11008, 151936, no_bias=False)
    # LoRA's default target is the fused c_attn (peft's qkv default for its names): r * (H + 3H) per block
    from memkit.planner.space import default_lora_targets

    assert default_lora_targets(spec) == ("c_attn",)
    assert spec.lora_params(16, ("c_attn",)) == 32 * 16 * (4096 + 3 * 4096)


def test_qwen1_size_mismatch_is_one_line():
    with pytest.raises(MemkitError, match=r"kv_channels=64 x num_attention_heads=32 != hidden_size=4096"):
        spec_from_config({**QWEN_7B, "kv_channels": 64}, name="bad")


def test_estimate_says_what_it_priced_and_unknown_remote_code_exits_2(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN_7B))
    assert main(["estimate", "--model", str(path), "--gpu", "h100-80gb", "--seq-len", "512"]) == 0
    out = capsys.readouterr().out
    assert sum("priced as a Llama-style decoder" in line for line in out.splitlines()) == 1
    other = {"model_type": "memkit_unmapped_remote", "architectures": ["XForCausalLM"],
             "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}, "hidden_size": 512,
             "intermediate_size": 1376, "num_hidden_layers": 4, "num_attention_heads": 8, "vocab_size": 32000}
    path.write_text(json.dumps(other))
    assert main(["estimate", "--model", str(path), "--gpu", "h100-80gb"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "'memkit_unmapped_remote'" in err and "XForCausalLM" in err and "--trust-remote-code" in err


# ---------------------------------------------------------------- --trust-remote-code: the folder's own code

_CONFIGURATION = '''
from transformers import PretrainedConfig


class TinyQwenConfig(PretrainedConfig):
    model_type = "qwen"

    def __init__(self, vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 kv_channels=16, intermediate_size=344, no_bias=True, tie_word_embeddings=False, **kwargs):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.kv_channels = num_attention_heads, kv_channels
        self.intermediate_size, self.no_bias = intermediate_size, no_bias
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
'''

# Written for this test with the parameter shapes of modeling_qwen.py (not its code): fused c_attn with
# bias, c_proj, two half-width MLP branches, RMSNorm weights, untied lm_head.
_MODELING = '''
import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_tiny_qwen import TinyQwenConfig


class Norm(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(h))

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).type_as(x) * self.weight


class Attn(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads, p = c.num_attention_heads, c.kv_channels * c.num_attention_heads
        self.c_attn = torch.nn.Linear(c.hidden_size, 3 * p)
        self.c_proj = torch.nn.Linear(c.hidden_size, p, bias=not c.no_bias)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.c_attn(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(a.transpose(1, 2).reshape(b, s, h))


class Mlp(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        half, bias = c.intermediate_size // 2, not c.no_bias
        self.w1 = torch.nn.Linear(c.hidden_size, half, bias=bias)
        self.w2 = torch.nn.Linear(c.hidden_size, half, bias=bias)
        self.c_proj = torch.nn.Linear(half, c.hidden_size, bias=bias)

    def forward(self, x):
        return self.c_proj(self.w1(x) * torch.nn.functional.silu(self.w2(x)))


class Block(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = Norm(c.hidden_size), Attn(c), Norm(c.hidden_size), Mlp(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyQwenLMHeadModel(PreTrainedModel):
    config_class = TinyQwenConfig
    base_model_prefix = "transformer"
    _supports_sdpa = True

    def __init__(self, config):
        super().__init__(config)
        self.wte = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = torch.nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.ln_f = Norm(config.hidden_size)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def get_output_embeddings(self):
        return self.lm_head

    def prepare_inputs_for_generation(self, input_ids, **kwargs):  # QWenLMHeadModel defines one; peft's
        return {"input_ids": input_ids}                            # PeftModelForCausalLM reads it

    def forward(self, input_ids, labels=None, **kwargs):
        x = self.wte(input_ids)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return CausalLMOutput(loss=loss, logits=logits)
'''


@pytest.fixture()
def remote_folder(tmp_path):
    pytest.importorskip("torch")
    folder = tmp_path / f"tiny_qwen_{tmp_path.name}"  # dynamic modules are cached by folder name
    folder.mkdir()
    (folder / "configuration_tiny_qwen.py").write_text(_CONFIGURATION)
    (folder / "modeling_tiny_qwen.py").write_text(_MODELING)
    config = {"model_type": "qwen", "architectures": ["TinyQwenLMHeadModel"], "auto_map": {
        "AutoConfig": "configuration_tiny_qwen.TinyQwenConfig",
        "AutoModelForCausalLM": "modeling_tiny_qwen.TinyQwenLMHeadModel"},
        "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "kv_channels": 16, "intermediate_size": 344, "no_bias": True, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_trust_remote_code_builds_and_traces_the_folder_code_and_agrees_with_the_mapping(remote_folder):
    from memkit.estimate.memory import estimate_memory
    from memkit.spec.hardware import Hardware, find_gpu

    mapped = load_model_spec(str(remote_folder))
    trusted = load_model_spec(str(remote_folder), trust_remote_code=True)
    assert not mapped.traced and trusted.traced and trusted.architecture == "TinyQwenLMHeadModel"
    assert trusted.num_params == mapped.num_params == qwen1_params(64, 2, 344, 1000)
    assert not any("Llama-style" in a for a in trusted.approximations)
    plan = TrainingPlan(engine="torch", precision="fp32", micro_batch_size=2, seq_len=64)
    cpu = Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=1)
    traced = estimate_memory(trusted, plan, cpu, device="cpu")
    hand = estimate_memory(mapped, plan, cpu, device="cpu")
    # the same weights and states either way; activations from the trace vs the hand tape
    assert traced.components["weights"] == hand.components["weights"]
    assert traced.allocated_peak_bytes == pytest.approx(hand.allocated_peak_bytes, rel=0.10)


def test_trust_remote_code_failure_is_one_line(remote_folder):
    (remote_folder / "modeling_tiny_qwen.py").write_text("raise RuntimeError('broken remote code')\n")
    with pytest.raises(MemkitError, match=r"--trust-remote-code: .*RuntimeError: broken remote code"):
        load_model_spec(str(remote_folder), trust_remote_code=True)


def _finetune(folder, out, *extra):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "memkit.finetune", "--model", str(folder), "--data", "synthetic",
                           "--output-dir", str(out), "--max-steps", "2", "--init", "random", "--seq-len", "32",
                           *extra], capture_output=True, text=True, timeout=600)


def test_the_runner_refuses_remote_code_without_the_flag_in_one_line(remote_folder, tmp_path):
    out = tmp_path / "run"
    proc = _finetune(remote_folder, out)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if "error:" in x]
    assert "model_type 'qwen'" in line and "pass --trust-remote-code" in line and len(line) < 400
    assert not out.exists()  # refused before the output folder is made


@pytest.mark.slow  # a real 2-step run of the runner (one process)
def test_the_runner_trains_the_folder_code_under_trust_remote_code(remote_folder, tmp_path):
    out = tmp_path / "run"
    proc = _finetune(remote_folder, out, "--trust-remote-code", "--lora-rank", "4", "--lora-targets", "c_attn")
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    steps = [e for e in log if e.get("event") == "step"]
    assert [e["step"] for e in steps] == [1, 2] and all(e["loss"] > 0 for e in steps)
    # the saved folder carries the model's own code, so from_pretrained(..., trust_remote_code=True) loads it
    assert (out / "final" / "modeling_tiny_qwen.py").is_file()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out / "final"), trust_remote_code=True)
    assert type(model).__name__ == "TinyQwenLMHeadModel"
    assert sum(p.numel() for p in model.parameters()) == qwen1_params(64, 2, 344, 1000)
    # checkpointing a model whose code does not support it: one line, not transformers' traceback
    proc = _finetune(remote_folder, tmp_path / "ckpt", "--trust-remote-code", "--checkpointing", "full")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "does not support activation checkpointing" in proc.stderr and "--checkpointing none" in proc.stderr


def test_a_plan_made_under_trust_remote_code_passes_it_to_the_runner(remote_folder, tmp_path, capsys):
    out = tmp_path / "bundle"
    assert main(["suggest", "--model", str(remote_folder), "--trust-remote-code", "--gpu", "rtx-4090",
                 "--global-batch-size", "8", "--seq-len", "64", "--out", str(out)]) == 0
    assert json.loads((out / "plan.json").read_text())["trust_remote_code"] is True
    commands = [x for x in (out / "README.md").read_text().splitlines()
                if x.startswith(("memkit train ", "accelerate launch "))]
    assert len(commands) >= 3 and all(" --trust-remote-code " in c for c in commands)
    # the runner's parser takes what the bundle passes (memkit.train.main.add_arguments)
    import argparse
    import shlex

    from memkit.train.main import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    launch = next(c for c in commands if c.startswith("accelerate launch "))
    argv = shlex.split(launch)
    args, _ = parser.parse_known_args(argv[argv.index("memkit.finetune") + 1:])
    assert args.trust_remote_code and args.model == str(remote_folder)
