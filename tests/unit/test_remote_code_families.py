"""Remote-code families mapped structurally (issue 20 item 4), beyond Qwen-1 (test_remote_code.py):
ChatGLM2/3 (model_type 'chatglm'), Baichuan/Baichuan2 ('baichuan'), InternLM ('internlm') and InternLM2
('internlm2').

- Each parameter count is the formula hand-worked here from the family's modeling file (cited per
  function) on the config.json as published (tests/golden/remote_configs/), and equals the published total.
- `estimate` prints one line saying what the model was priced as and why.
- Without --trust-remote-code the folder's own code never runs; with it, it does.
- A config the mapping cannot price is one line and exit 2.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from memkit.cli.main import main
from memkit.errors import MemkitError
from memkit.planner.space import default_lora_targets
from memkit.spec.hf import load_model_spec, spec_from_config

CONFIGS = Path(__file__).resolve().parents[1] / "golden" / "remote_configs"


def _config(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


def chatglm_params(h, layers, heads, kv_channels, groups, ffn, vocab) -> int:
    """THUDM/chatglm3-6b modeling_chatglm.py: per GLMBlock two RMSNorm weights (H each), query_key_value
    Linear(H, kv_channels * (heads + 2 * groups)) with bias (add_qkv_bias), dense Linear(kv_channels * heads, H),
    dense_h_to_4h Linear(H, 2 * ffn), dense_4h_to_h Linear(ffn, H), no other bias; word_embeddings (V x H),
    final_layernorm (H), output_layer Linear(H, V, bias=False)."""
    qkv = kv_channels * (heads + 2 * groups)
    block = 2 * h + (h * qkv + qkv) + kv_channels * heads * h + h * 2 * ffn + ffn * h
    return vocab * h + layers * block + h + vocab * h


def baichuan_params(h, layers, inter, vocab) -> int:
    """baichuan-inc/Baichuan2-13B-Chat modeling_baichuan.py: per BaichuanLayer two RMSNorm weights, W_pack
    Linear(H, 3H), o_proj Linear(H, H), gate_proj/up_proj Linear(H, I), down_proj Linear(I, H), no bias;
    embed_tokens (V x H), norm (H), NormHead weight (V x H)."""
    return vocab * h + layers * (2 * h + 3 * h * h + h * h + 3 * h * inter) + h + vocab * h


def internlm2_params(h, layers, heads, kv_heads, inter, vocab) -> int:
    """internlm/internlm2-7b modeling_internlm2.py: per InternLM2DecoderLayer attention_norm + ffn_norm
    (H each), wqkv Linear(H, (heads + 2 kv) * H/heads), wo Linear(H, H) (bias false in the config), w1/w3
    Linear(H, I), w2 Linear(I, H); tok_embeddings (V x H), norm (H), output Linear(H, V, bias=False)."""
    hd = h // heads
    return vocab * h + layers * (2 * h + h * (heads + 2 * kv_heads) * hd + h * h + 3 * h * inter) + h + vocab * h


def internlm_params(h, layers, inter, vocab, *, bias) -> int:
    """InternLM/InternLM tools/transformers/internlm_model/modeling_internlm.py: per InternLMDecoderLayer two
    RMSNorm weights, q/k/v/o_proj Linear(H, H, bias=config.bias), gate/up_proj Linear(H, I), down_proj
    Linear(I, H); embed_tokens (V x H), norm (H), lm_head Linear(H, V, bias=False)."""
    return vocab * h + layers * (2 * h + 4 * (h * h + bias * h) + 3 * h * inter) + h + vocab * h


# config folder -> (the hand-worked count, the published total: the model cards' safetensors totals,
# 6.24B / 7.51B / 13.9B / 7.74B; InternLM-20B's "20B" the model card's rounding)
CASES = {
    "chatglm3-6b": (chatglm_params(4096, 28, 32, 128, 2, 13696, 65024), 6_243_584_000),
    "chatglm2-6b": (chatglm_params(4096, 28, 32, 128, 2, 13696, 65024), 6_243_584_000),
    "baichuan2-7b": (baichuan_params(4096, 32, 11008, 125696), 7_505_973_248),
    "baichuan2-13b": (baichuan_params(5120, 40, 13696, 125696), 13_896_668_160),
    "internlm2-7b": (internlm2_params(4096, 32, 32, 8, 14336, 92544), 7_737_708_544),
    "internlm-20b": (internlm_params(5120, 60, 13824, 103168, bias=False), 20_088_714_240),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_mapped_counts_are_the_modeling_files_and_the_published_totals(name):
    spec = load_model_spec(str(CONFIGS / name))
    formula, published = CASES[name]
    assert spec.num_params == formula == published
    assert not spec.traced
    [line] = spec.approximations
    assert line.startswith("priced as a Llama-style decoder") and f"because model_type '{spec.model_type}'" in line
    assert "--trust-remote-code" in line and "\n" not in line


def test_structure_read_from_the_config():
    glm = load_model_spec(str(CONFIGS / "chatglm3-6b"))
    assert (glm.num_key_value_heads, glm.head_dim, glm.intermediate_size) == (2, 128, 13696)
    assert [lin.role for lin in glm.layer_linears] == ["qkv", "o", "gate_up", "down"]
    assert glm.max_position_embeddings == 32768
    # multi_query_attention off: every head has its own K/V (3 * kv_channels * heads)
    mha = spec_from_config({**_config("chatglm3-6b"), "multi_query_attention": False}, name="mha")
    assert mha.num_key_value_heads == 32 and mha.layer_linears[0].out_features == 3 * 4096
    # Baichuan: rope at hidden_size 4096 (the 7B models), ALiBi otherwise (vLLM's baichuan.py rule)
    b7, b13 = (load_model_spec(str(CONFIGS / n)) for n in ("baichuan2-7b", "baichuan2-13b"))
    assert (b7.position_embedding, b7.block.sdpa) == ("rope", True)
    assert (b13.position_embedding, b13.block.sdpa) == ("alibi", False)
    assert b13.max_position_embeddings == 4096  # model_max_length
    v1 = spec_from_config({**_config("baichuan2-7b"), "architectures": ["BaiChuanForCausalLM"],
                           "vocab_size": 64000}, name="baichuan-7b")
    assert v1.position_embedding == "rope" and v1.num_params == baichuan_params(4096, 32, 11008, 64000)
    # InternLM2: eager attention (no SDPA path in its code) unless the config asks for flash_attention_2
    il = load_model_spec(str(CONFIGS / "internlm2-7b"))
    assert (il.num_key_value_heads, il.block.sdpa, il.block.softmax_fp32) == (8, False, True)
    flash = spec_from_config({**_config("internlm2-7b"), "attn_implementation": "flash_attention_2"}, name="f")
    assert flash.block.sdpa
    biased = spec_from_config({**_config("internlm2-7b"), "bias": True}, name="b")
    assert biased.num_params == il.num_params + 32 * ((32 + 16) * 128 + 4096)  # wqkv and wo biases
    # InternLM (v1): every head has its own K/V whatever num_key_value_heads says; bias defaults to true
    v1_config = {k: v for k, v in _config("internlm-20b").items() if k != "bias"}
    v1 = spec_from_config({**v1_config, "num_key_value_heads": 8}, name="internlm-20b")
    assert v1.num_key_value_heads == 40 and not v1.block.sdpa
    assert v1.num_params == internlm_params(5120, 60, 13824, 103168, bias=True)


def test_lora_targets_use_each_codebase_names():
    expect = {"chatglm3-6b": ("query_key_value", 4096 + 4608), "baichuan2-7b": ("W_pack", 4096 + 3 * 4096),
              "internlm2-7b": ("wqkv", 4096 + 6144)}
    for name, (target, in_out) in expect.items():
        spec = load_model_spec(str(CONFIGS / name))
        assert default_lora_targets(spec) == (target,)
        assert spec.lora_params(8, (target,)) == spec.num_layers * 8 * in_out


@pytest.mark.parametrize("name", ["chatglm3-6b", "baichuan2-13b", "internlm2-7b"])
def test_estimate_prints_the_mapping_in_one_line(name, capsys):
    assert main(["estimate", "--model", str(CONFIGS / name), "--gpu", "h100-80gb", "--seq-len", "512"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if "priced as a Llama-style decoder" in x]
    assert len(lines) == 1 and "ships remote code memkit does not run" in lines[0]


# configuration/modeling files that leave a mark when Python runs them (transformers runs a copy from its
# modules cache, so the mark's path is absolute), then fail
_MARKING = "import pathlib\npathlib.Path({mark!r}).write_text('ran')\nraise RuntimeError('remote code ran')\n"


def test_the_folder_code_runs_only_under_trust_remote_code(tmp_path):
    folder = tmp_path / f"glm_{tmp_path.name}"  # dynamic modules are cached by folder name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_config("chatglm3-6b")))
    for module in ("configuration_chatglm.py", "modeling_chatglm.py"):
        (folder / module).write_text(_MARKING.format(mark=str(tmp_path / "ran.txt")))
    spec = load_model_spec(str(folder))
    assert spec.num_params == 6_243_584_000 and not (tmp_path / "ran.txt").exists()
    with pytest.raises(MemkitError, match=r"--trust-remote-code: .*RuntimeError: remote code ran"):
        load_model_spec(str(folder), trust_remote_code=True)
    assert (tmp_path / "ran.txt").exists()


@pytest.mark.parametrize(("name", "change", "message"), [
    ("chatglm3-6b", {"position_encoding_2d": True, "inner_hidden_size": 16384}, "ChatGLM-6B (v1)"),
    ("chatglm3-6b", {"pre_seq_len": 128}, "pre_seq_len"),
    ("chatglm3-6b", {"multi_query_group_num": 3}, "multi_query_group_num=3"),
    ("baichuan2-7b", {"num_attention_heads": 30}, "not divisible by num_attention_heads=30"),
    ("internlm2-7b", {"num_key_value_heads": 5}, "num_key_value_heads=5"),
    ("internlm2-7b", {"vocab_size": None}, "lacks vocab_size"),
])
def test_configs_the_mapping_cannot_price_are_one_line_and_exit_2(tmp_path, capsys, name, change, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_config(name), **change}))
    assert main(["estimate", "--model", str(path), "--gpu", "h100-80gb"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and message in err


def test_an_unmapped_remote_architecture_names_the_mapped_families(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "memkit_unknown_remote", "architectures": ["YForCausalLM"],
                                "auto_map": {"AutoModelForCausalLM": "modeling_y.YForCausalLM"}}))
    assert main(["estimate", "--model", str(path), "--gpu", "h100-80gb"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'memkit_unknown_remote'" in err and "--trust-remote-code" in err
    assert "baichuan, chatglm, internlm, internlm2, qwen" in err


# ---------------------------------------------------------------- --trust-remote-code: a ChatGLM-shaped folder

_GLM_CONFIGURATION = '''
from transformers import PretrainedConfig


class TinyGLMConfig(PretrainedConfig):
    model_type = "chatglm"

    def __init__(self, padded_vocab_size=1000, hidden_size=64, num_layers=2, num_attention_heads=4, kv_channels=16,
                 multi_query_group_num=2, ffn_hidden_size=96, add_qkv_bias=True, **kwargs):
        self.padded_vocab_size, self.hidden_size, self.num_layers = padded_vocab_size, hidden_size, num_layers
        self.vocab_size = padded_vocab_size  # as THUDM/chatglm3-6b configuration_chatglm.py sets it
        self.num_attention_heads, self.kv_channels = num_attention_heads, kv_channels
        self.multi_query_group_num, self.ffn_hidden_size = multi_query_group_num, ffn_hidden_size
        self.add_qkv_bias = add_qkv_bias
        super().__init__(**kwargs)
'''

# Written for this test with the parameter shapes and the attention data flow of modeling_chatglm.py (not
# its code): fused query_key_value with grouped K/V, rope on half of each head, K/V expanded to every head
# before SDPA, fused swiglu dense_h_to_4h, RMSNorm weights, untied output_layer.
_GLM_MODELING = '''
import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_tiny_glm import TinyGLMConfig


class Norm(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(h))

    def forward(self, x):
        return (self.weight * (x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5))).to(x.dtype)


def rope_half(x):
    s, d = x.shape[1], x.shape[-1] // 2
    angle = torch.arange(s, dtype=torch.float32)[:, None] * torch.arange(1, d // 2 + 1, dtype=torch.float32)
    cos, sin = angle.cos().to(x.dtype)[None, :, None], angle.sin().to(x.dtype)[None, :, None]
    rot, rest = x[..., :d], x[..., d:]
    a, b = rot[..., 0::2], rot[..., 1::2]
    return torch.cat((torch.stack((a * cos - b * sin, b * cos + a * sin), -1).flatten(-2), rest), -1)


class Attn(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads, self.groups, self.d = c.num_attention_heads, c.multi_query_group_num, c.kv_channels
        self.query_key_value = torch.nn.Linear(c.hidden_size, self.d * (self.heads + 2 * self.groups),
                                               bias=c.add_qkv_bias)
        self.dense = torch.nn.Linear(self.d * self.heads, c.hidden_size, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.query_key_value(x).split([self.heads * self.d, self.groups * self.d, self.groups * self.d], -1)
        q, k = rope_half(q.view(b, s, self.heads, self.d)), rope_half(k.view(b, s, self.groups, self.d))
        v = v.view(b, s, self.groups, self.d)
        rep = self.heads // self.groups
        k, v = (t.unsqueeze(-2).expand(-1, -1, -1, rep, -1).contiguous().view(b, s, self.heads, self.d) for t in (k, v))
        a = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return self.dense(a.transpose(1, 2).reshape(b, s, self.heads * self.d))


class Mlp(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense_h_to_4h = torch.nn.Linear(c.hidden_size, 2 * c.ffn_hidden_size, bias=False)
        self.dense_4h_to_h = torch.nn.Linear(c.ffn_hidden_size, c.hidden_size, bias=False)

    def forward(self, x):
        a, b = self.dense_h_to_4h(x).chunk(2, -1)
        return self.dense_4h_to_h(torch.nn.functional.silu(a) * b)


class Block(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm, self.self_attention = Norm(c.hidden_size), Attn(c)
        self.post_attention_layernorm, self.mlp = Norm(c.hidden_size), Mlp(c)

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyGLMForConditionalGeneration(PreTrainedModel):
    config_class = TinyGLMConfig
    base_model_prefix = "transformer"
    _supports_sdpa = True

    def __init__(self, config):
        super().__init__(config)
        self.word_embeddings = torch.nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.final_layernorm = Norm(config.hidden_size)
        self.output_layer = torch.nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.word_embeddings

    def forward(self, input_ids, labels=None, **kwargs):
        x = self.word_embeddings(input_ids)
        for block in self.layers:
            x = block(x)
        logits = self.output_layer(self.final_layernorm(x))
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return CausalLMOutput(loss=loss, logits=logits)
'''


def test_trust_remote_code_traces_a_chatglm_folder_and_agrees_with_the_mapping(tmp_path):
    pytest.importorskip("torch")
    from memkit.estimate.memory import estimate_memory
    from memkit.plan.plan import TrainingPlan
    from memkit.spec.hardware import Hardware, find_gpu

    folder = tmp_path / f"tiny_glm_{tmp_path.name}"  # dynamic modules are cached by folder name
    folder.mkdir()
    (folder / "configuration_tiny_glm.py").write_text(_GLM_CONFIGURATION)
    (folder / "modeling_tiny_glm.py").write_text(_GLM_MODELING)
    config = {**_config("chatglm3-6b"), "architectures": ["TinyGLMForConditionalGeneration"], "auto_map": {
        "AutoConfig": "configuration_tiny_glm.TinyGLMConfig",
        "AutoModelForCausalLM": "modeling_tiny_glm.TinyGLMForConditionalGeneration"},
        "padded_vocab_size": 1000, "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "kv_channels": 16,
        "multi_query_group_num": 2, "ffn_hidden_size": 96, "seq_length": 256}
    (folder / "config.json").write_text(json.dumps(config))
    mapped = load_model_spec(str(folder))
    trusted = load_model_spec(str(folder), trust_remote_code=True)
    assert not mapped.traced and trusted.traced
    assert trusted.num_params == mapped.num_params == chatglm_params(64, 2, 4, 16, 2, 96, 1000)
    plan = TrainingPlan(engine="torch", precision="fp32", micro_batch_size=2, seq_len=64)
    cpu = Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=1)
    traced = estimate_memory(trusted, plan, cpu, device="cpu")
    hand = estimate_memory(mapped, plan, cpu, device="cpu")
    # the same weights and states either way; activations from the trace of the folder's code vs the hand tape
    for part in ("weights", "optimizer_states", "logits_and_loss"):
        assert traced.components[part] == hand.components[part]
    assert not any("Llama-style" in a for a in trusted.approximations)
