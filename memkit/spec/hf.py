"""Read a Hugging Face config.json into a ModelSpec: the only place HF config keys are read.

`load_model_spec(arg)` accepts what memkit.spec.resolve.resolve_model resolves (a config.json or
its folder, a catalog name or alias, a hub id in the local HF cache). memkit never downloads.

Parameter counts are exact: each family below mirrors its transformers 5.24 modeling file (cited per
family), and tests/unit/test_hf_spec.py compares every count with sum(p.numel()) of the model that
transformers builds on the meta device (tied weights counted once). Defaults for absent keys are the
family's config-class defaults (transformers/models/<family>/configuration_<family>.py).
No torch or transformers import here: config work is instant (memkit/ARCHITECTURE.md, "Conventions").
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from memkit.errors import MemkitError
from memkit.presets_dir import presets_dir
from memkit.spec.model import Block, Linear, ModelSpec


# ---------------------------------------------------------------- the bundled catalog

@dataclass(frozen=True, slots=True, kw_only=True)
class CatalogModel:
    name: str
    hub_id: str
    config_path: Path
    aliases: tuple[str, ...] = ()
    note: str = ""


def model_catalog() -> dict[str, CatalogModel]:
    """Every bundled model by catalog name, in catalog order."""
    return _catalog(str(presets_dir()))


@lru_cache(maxsize=4)
def _catalog(root: str) -> dict[str, CatalogModel]:
    index = Path(root) / "models" / "catalog.json"
    data = _read_json(index)
    out = {}
    for name, row in data["models"].items():
        out[name] = CatalogModel(name=name, hub_id=row["hub_id"], config_path=index.parent / name / "config.json",
                                 aliases=tuple(row.get("aliases", ())), note=row.get("note", ""))
    return out


def _key(text: str) -> str:
    return text.strip().lower().replace("_", "-")


def find_catalog_model(name: str) -> CatalogModel | None:
    """The catalog entry whose name, alias, hub id or hub repo name matches `name`, or None."""
    key = _key(name)
    for entry in model_catalog().values():
        keys = {entry.name, entry.hub_id, entry.hub_id.split("/")[-1], *entry.aliases}
        if key in {_key(k) for k in keys}:
            return entry
    return None


# ---------------------------------------------------------------- resolution

def load_model_spec(name_or_path: str, *, trust_remote_code: bool = False) -> ModelSpec:
    """A ModelSpec of the model `name_or_path` names (memkit.spec.resolve, the one resolver);
    trust_remote_code: spec_from_config's."""
    from memkit.spec.resolve import resolve_model

    source = resolve_model(name_or_path)
    config = _read_json(source.config_path)
    # not kept with trust_remote_code: the folder's own code is read too, and may change between loads
    key = None if trust_remote_code else (json.dumps(config, sort_keys=True), source.name, source.hub_id,
                                          str(source.config_path))
    spec = _LOADED.get(key)
    if spec is None:
        spec = spec_from_config(config, name=source.name, hub_id=source.hub_id,
                                config_path=str(source.config_path), trust_remote_code=trust_remote_code)
        if key is not None:
            _LOADED[key] = spec
    return spec


_LOADED: dict[tuple, ModelSpec] = {}
"""load_model_spec's specs by what spec_from_config reads (the config's contents, its name, hub id
and path): one object per equal input, so that the estimators' memos (lru caches keyed on the
spec, e.g. estimate/throughput.py _memo_layer_passes) find a process's later requests by identity
instead of comparing every field of an equal spec (presets_gen loads the spec per request)."""


def _read_json(path: Path) -> dict:
    from memkit.fileio import read_json_object  # OS/decoding/JSON errors as one line

    return read_json_object(path, what="config file", noun="config object")


# ---------------------------------------------------------------- config access

class _Cfg:
    """A config dict with the checks every family needs. A JSON null reads as absent."""

    def __init__(self, data: dict, source: str):
        self.data = data
        self.source = source
        self.model_type = data.get("model_type")

    def get(self, *keys, default=None):
        """The first of `keys` that is set (attribute_map aliases), else `default`."""
        for key in keys:
            if self.data.get(key) is not None:
                return self.data[key]
        return default

    def need(self, *groups) -> list[int]:
        """Positive ints for each key group (a str, or a tuple of alias spellings); one error lists all missing."""
        values, missing = [], []
        for group in groups:
            names = (group,) if isinstance(group, str) else group
            value = self.get(*names)
            if value is None:
                missing.append(names[0])
            values.append(value)
        if missing:
            raise MemkitError(f"{self.source} (model_type {self.model_type}) lacks {', '.join(missing)}; "
                              "a transformer config.json needs them: use the model's full config.json")
        for group, value in zip(groups, values):
            self.check_int(group if isinstance(group, str) else group[0], value)
        return values

    def pos_int(self, key: str, default: int, *aliases) -> int:
        value = self.get(key, *aliases, default=default)
        return self.check_int(key, value)

    def check_int(self, key: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MemkitError(f"{self.source}: {key}={value!r} must be a positive integer")
        if value >= 2**31:  # no released model comes near; sizes past int32 are a typo (issue 11)
            raise MemkitError(f"{self.source}: {key}={value} is implausibly large (>= 2^31); fix the config")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default=default)
        if not isinstance(value, bool):
            raise MemkitError(f"{self.source}: {key}={value!r} must be true or false")
        return value

    def num(self, key: str, default: float, *aliases) -> float:
        value = self.get(key, *aliases, default=default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MemkitError(f"{self.source}: {key}={value!r} must be a number")
        return float(value)

    def heads(self, n_heads: int, kv_key: str = "num_key_value_heads", kv_default=None) -> int:
        """KV heads: absent -> the class default (None means n_heads); null -> n_heads."""
        raw = self.data[kv_key] if kv_key in self.data else kv_default
        n_kv = n_heads if raw is None else self.check_int(kv_key, raw)
        if n_heads % n_kv:
            raise MemkitError(f"{self.source}: num_attention_heads={n_heads} is not a multiple of "
                              f"{kv_key}={n_kv}; fix the config")
        return n_kv

    def head_dim(self, hidden: int, n_heads: int, default=None) -> int:
        value = self.get("head_dim", default=default)
        if value is None:
            if hidden % n_heads:
                raise MemkitError(f"{self.source}: hidden_size={hidden} is not divisible by "
                                  f"num_attention_heads={n_heads} and head_dim is not set; fix the config")
            return hidden // n_heads
        return self.check_int("head_dim", value)

    def rope_extra(self) -> dict:
        out = {}
        for key in ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "rotary_pct",
                    "sliding_window", "attn_logit_softcapping", "final_logit_softcapping"):
            if self.data.get(key) is not None:
                out[key] = self.data[key]
        return out


# ---------------------------------------------------------------- block pieces

def _lin(name, in_f, out_f, bias, role, tp, count=1) -> Linear:
    # tp_style follows Megatron-LM (Shoeybi et al. 2019, Sec. 3): the first GEMM of the MLP and the
    # Q/K/V projections are split by columns (outputs), the second MLP GEMM and the attention output
    # projection by rows (inputs); everything else is replicated.
    return Linear(name=name, in_features=in_f, out_features=out_f, bias=bias, role=role, count=count, tp_style=tp)


def _attention(h, n_heads, n_kv, hd, *, qkv_bias, o_bias, names=("q_proj", "k_proj", "v_proj", "o_proj"),
               kv_in=None) -> tuple[Linear, ...]:
    q, k, v, o = names
    kv_in = kv_in or h
    return (_lin(q, h, n_heads * hd, qkv_bias, "q", "column"),
            _lin(k, kv_in, n_kv * hd, qkv_bias, "k", "column"),
            _lin(v, kv_in, n_kv * hd, qkv_bias, "v", "column"),
            _lin(o, n_heads * hd, h, o_bias, "o", "row"))


def _gated_mlp(h, inter, bias, names=("gate_proj", "up_proj", "down_proj")) -> tuple[Linear, ...]:
    gate, up, down = names
    return (_lin(gate, h, inter, bias, "gate", "column"), _lin(up, h, inter, bias, "up", "column"),
            _lin(down, inter, h, bias, "down", "row"))


def _mlp(h, inter, bias, names=("fc1", "fc2"), down_bias=None) -> tuple[Linear, ...]:
    up, down = names
    return (_lin(up, h, inter, bias, "up", "column"),
            _lin(down, inter, h, bias if down_bias is None else down_bias, "down", "row"))


def _sum(linears) -> int:
    return sum(lin.num_params for lin in linears)


def _common(c: _Cfg, **fields) -> dict:
    """Spec fields every family shares, plus the family's own."""
    fields.setdefault("extra", {})
    fields["extra"] = {**c.rope_extra(), **fields["extra"]}
    return fields


# ---------------------------------------------------------------- decoder families, RoPE + RMSNorm

def _llama_like(c: _Cfg, *, architecture, hidden_act, tie_default, kv_default=None, head_dim_default=None,
                q_bias=False, o_bias=False, mlp_bias=False, norms_per_block=2, qk_norm=False, fused=False,
                experts=0, top_k=0, extra=None, block=None) -> dict:
    """Llama-style pre-norm decoder block: RMSNorm(H) weights only, attention, (gated) MLP.

    llama: transformers/models/llama/modeling_llama.py (LlamaAttention, LlamaMLP, LlamaDecoderLayer).
    """
    h, n_layers, n_heads, inter, vocab = c.need("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                "intermediate_size", "vocab_size")
    n_kv = c.heads(n_heads, kv_default=kv_default)
    hd = c.head_dim(h, n_heads, default=head_dim_default)
    if fused:  # Phi-3 fuses Q/K/V and gate/up into one Linear each (phi3/modeling_phi3.py, Phi3Attention, Phi3MLP)
        linears = (_lin("qkv_proj", h, (n_heads + 2 * n_kv) * hd, False, "qkv", "column"),
                   _lin("o_proj", n_heads * hd, h, False, "o", "row"),
                   _lin("gate_up_proj", h, 2 * inter, False, "gate_up", "column"),
                   _lin("down_proj", inter, h, False, "down", "row"))
    else:
        linears = _attention(h, n_heads, n_kv, hd, qkv_bias=q_bias, o_bias=o_bias)
        if experts:  # mixtral/modeling_mixtral.py: MixtralTopKRouter weight (E, H); MixtralExperts 3-D params
            linears += (_lin("gate", h, experts, False, "router", "replicate"),
                        _lin("experts.gate_up_proj", h, 2 * inter, False, "expert_gate_up", "column", experts),
                        _lin("experts.down_proj", inter, h, False, "expert_down", "row", experts))
        else:
            linears += _gated_mlp(h, inter, mlp_bias)
    norms = norms_per_block * h + (2 * hd if qk_norm else 0)  # RMSNorm has a weight and no bias
    tie = c.flag("tie_word_embeddings", tie_default)
    return _common(
        c, architecture=architecture, kind="decoder", num_layers=n_layers, hidden_size=h,
        num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=hd, intermediate_size=inter,
        vocab_size=vocab, max_position_embeddings=c.pos_int("max_position_embeddings", 2048), hidden_act=hidden_act,
        gated_mlp=True, norm_type="rmsnorm", position_embedding="rope",
        attention_dropout=c.num("attention_dropout", 0.0), hidden_dropout=0.0,
        num_experts=experts, num_experts_per_tok=top_k, tie_word_embeddings=tie, layer_linears=linears,
        embedding_params=vocab * h, layer_params=_sum(linears) + norms,
        head_params=h + (0 if tie else vocab * h), extra=extra or {},
        # eager_attention_forward in every Llama-style modeling file: softmax(..., dtype=torch.float32)
        block=block or Block(softmax_fp32=True, qk_norm=qk_norm))


def _llama(c):
    # llama/configuration_llama.py defaults; attention_bias and mlp_bias switch every projection's bias.
    return _llama_like(c, architecture="LlamaForCausalLM", hidden_act=c.get("hidden_act", default="silu"),
                       tie_default=False, q_bias=c.flag("attention_bias", False),
                       o_bias=c.flag("attention_bias", False), mlp_bias=c.flag("mlp_bias", False))


def _mistral(c):
    # mistral/modeling_mistral.py: no biases anywhere; kv heads default 8.
    return _llama_like(c, architecture="MistralForCausalLM", hidden_act=c.get("hidden_act", default="silu"),
                       tie_default=False, kv_default=8)


def _mixtral(c):
    # mixtral/modeling_mixtral.py: Mistral attention + MixtralSparseMoeBlock (router + fused 3-D experts).
    experts = c.pos_int("num_local_experts", 8, "num_experts")
    top_k = c.pos_int("num_experts_per_tok", 2)
    return _llama_like(c, architecture="MixtralForCausalLM", hidden_act=c.get("hidden_act", default="silu"),
                       tie_default=False, kv_default=8, experts=experts, top_k=top_k,
                       extra={"router_aux_loss_coef": c.num("router_aux_loss_coef", 0.001)})


def _qwen2(c):
    # qwen2/modeling_qwen2.py: q/k/v carry a bias, o_proj and the MLP do not; absent kv heads default to 32.
    extra = {"use_sliding_window": c.flag("use_sliding_window", False)}
    return _llama_like(c, architecture="Qwen2ForCausalLM", hidden_act=c.get("hidden_act", default="silu"),
                       tie_default=False, kv_default=32, q_bias=True, o_bias=False, extra=extra)


def _qwen3(c):
    # qwen3/modeling_qwen3.py: attention_bias on all four projections, RMSNorm q_norm/k_norm over head_dim.
    bias = c.flag("attention_bias", False)
    return _llama_like(c, architecture="Qwen3ForCausalLM", hidden_act=c.get("hidden_act", default="silu"),
                       tie_default=False, kv_default=32, head_dim_default=128, q_bias=bias, o_bias=bias,
                       qk_norm=True)


def _gemma_act(c, key):
    act = c.get(key, default="gelu_pytorch_tanh")
    # gemma/configuration_gemma.py: the legacy "gelu" of the official configs means the tanh approximation.
    return "gelu_pytorch_tanh" if act == "gelu" else act


def _gemma(c):
    # gemma/modeling_gemma.py: Llama block, tied embeddings by default, head_dim default 256.
    bias = c.flag("attention_bias", False)
    return _llama_like(c, architecture="GemmaForCausalLM", hidden_act=_gemma_act(c, "hidden_act"),
                       tie_default=True, kv_default=16, head_dim_default=256, q_bias=bias, o_bias=bias,
                       block=Block(softmax_fp32=True, rms_norm="gemma"))


def _gemma2(c):
    # gemma2/modeling_gemma2.py: four RMSNorms per block (pre/post attention, pre/post feed-forward).
    bias = c.flag("attention_bias", False)
    return _llama_like(c, architecture="Gemma2ForCausalLM", hidden_act=_gemma_act(c, "hidden_activation"),
                       tie_default=True, kv_default=4, head_dim_default=256, q_bias=bias, o_bias=bias,
                       norms_per_block=4, extra={"query_pre_attn_scalar": c.get("query_pre_attn_scalar")},
                       # Gemma2Attention: no SDPA path in transformers 5 (_supports_sdpa False); scores and
                       # final logits soft-capped with tanh (Gemma 2 report, Sec. 2) unless the cap is null.
                       block=Block(softmax_fp32=True, rms_norm="gemma", norm_placement="sandwich", sdpa=False,
                                   attn_softcap=c.data.get("attn_logit_softcapping", 50.0) is not None,
                                   final_softcap=c.data.get("final_logit_softcapping", 30.0) is not None))


def _gemma3_text(c):
    # gemma3/modeling_gemma3.py (Gemma3ForCausalLM): Gemma2 block plus q_norm/k_norm over head_dim.
    bias = c.flag("attention_bias", False)
    return _llama_like(c, architecture="Gemma3ForCausalLM", hidden_act=_gemma_act(c, "hidden_activation"),
                       tie_default=True, kv_default=4, head_dim_default=256, q_bias=bias, o_bias=bias,
                       norms_per_block=4, qk_norm=True,
                       extra={"sliding_window_pattern": c.get("sliding_window_pattern", default=6)},
                       block=Block(softmax_fp32=True, rms_norm="gemma", norm_placement="sandwich", qk_norm=True,
                                   attn_softcap=c.get("attn_logit_softcapping") is not None,
                                   final_softcap=c.get("final_logit_softcapping") is not None))


def _phi3(c):
    spec = _llama_like(c, architecture="Phi3ForCausalLM", hidden_act=c.get("hidden_act", default="silu"),
                       tie_default=False, fused=True)
    spec["hidden_dropout"] = c.num("resid_pdrop", 0.0)
    spec["extra"]["embedding_dropout"] = c.num("embd_pdrop", 0.0)
    return spec


# ---------------------------------------------------------------- remote-code families, mapped (issue 20)
# Configs whose model code ships with the checkpoint (`auto_map`, trust_remote_code): memkit does not run
# that code by default; each family here is the structure of its modeling file, read from the config's keys.

def _qwen1(c):
    """Qwen-1 (model_type 'qwen', QWenLMHeadModel; Qwen/Qwen-7B modeling_qwen.py and configuration_qwen.py):
    QWenAttention c_attn = Linear(H, 3 * kv_channels * heads) with bias, c_proj = Linear(H, kv_channels *
    heads, bias=not no_bias); QWenMLP w1, w2 = Linear(H, intermediate_size // 2) each (a1 * silu(a2): w2 is
    the gate), c_proj = Linear(intermediate_size // 2, H), all bias=not no_bias; QWenBlock ln_1, ln_2 and
    QWenModel ln_f are RMSNorm (weight only); wte Embedding(V, H); lm_head Linear(H, V, bias=False), untied.
    QWenConfig defaults: kv_channels 128, intermediate_size 22016, no_bias true, tie_word_embeddings false."""
    h, n_layers, n_heads, vocab = c.need("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    kv_channels = c.pos_int("kv_channels", 128)
    inter = c.pos_int("intermediate_size", 22016) // 2  # QWenMLP: intermediate_size // 2 per branch
    if kv_channels * n_heads != h:  # QWenAttention splits c_attn's output by hidden_size (split_size)
        raise MemkitError(f"{c.source}: kv_channels={kv_channels} x num_attention_heads={n_heads} != "
                          f"hidden_size={h}; Qwen-1's attention needs them equal: fix the config")
    bias = not c.flag("no_bias", True)
    linears = (_lin("c_attn", h, 3 * h, True, "qkv", "column"), _lin("c_proj", h, h, bias, "o", "row"),
               _lin("w2", h, inter, bias, "gate", "column"), _lin("w1", h, inter, bias, "up", "column"),
               _lin("c_proj", inter, h, bias, "down", "row"))
    tie = c.flag("tie_word_embeddings", False)
    return _common(
        c, architecture="QWenLMHeadModel", kind="decoder", num_layers=n_layers, hidden_size=h,
        num_attention_heads=n_heads, num_key_value_heads=n_heads, head_dim=kv_channels, intermediate_size=inter,
        vocab_size=vocab, max_position_embeddings=c.pos_int("max_position_embeddings", 8192, "seq_length"),
        hidden_act="silu", gated_mlp=True, norm_type="rmsnorm", position_embedding="rope",
        attention_dropout=c.num("attn_dropout_prob", 0.0), hidden_dropout=0.0, tie_word_embeddings=tie,
        layer_linears=linears, embedding_params=vocab * h, layer_params=_sum(linears) + 2 * h,
        head_params=h + (0 if tie else vocab * h), extra={"embedding_dropout": c.num("emb_dropout_prob", 0.0)},
        # QWenAttention._attn: softmax in the scores' dtype unless softmax_in_fp32; SDPA on torch 2
        block=Block(softmax_fp32=c.flag("softmax_in_fp32", False)))


def _chatglm(c):
    """ChatGLM2/ChatGLM3/GLM-4 (model_type 'chatglm', ChatGLMForConditionalGeneration; THUDM/chatglm3-6b
    modeling_chatglm.py and configuration_chatglm.py). SelfAttention.query_key_value = Linear(H, kv_channels *
    (heads + 2 * multi_query_group_num)) (3 * kv_channels * heads without multi_query_attention), bias =
    add_bias_linear or add_qkv_bias; dense = Linear(kv_channels * heads, H, bias=add_bias_linear). MLP:
    dense_h_to_4h = Linear(H, 2 * ffn_hidden_size) chunked into silu(x0) * x1 (swiglu), dense_4h_to_h =
    Linear(ffn_hidden_size, H). GLMBlock input_layernorm, post_attention_layernorm and GLMTransformer
    final_layernorm (post_layer_norm) are RMSNorm (weight) if rmsnorm else LayerNorm (weight + bias).
    Embedding.word_embeddings (padded_vocab_size, H); ChatGLMModel.output_layer = Linear(H, V, bias=False),
    never tied. RotaryEmbedding(kv_channels // 2): rope on half of each head. CoreAttention on torch 2 is SDPA
    with K/V expanded to every head. ChatGLMConfig defaults: kv_channels 128, multi_query_group_num 1,
    rmsnorm true, post_layer_norm true, add_bias_linear / add_qkv_bias false, seq_length 2048."""
    if "position_encoding_2d" in c.data or "inner_hidden_size" in c.data:  # THUDM/chatglm-6b (v1) keys
        raise MemkitError(f"{c.source}: a ChatGLM-6B (v1) config (2-D position encoding) has no mapping in memkit; "
                          "pass --trust-remote-code with the model folder to trace its own code")
    if c.get("pre_seq_len") is not None or c.flag("apply_residual_connection_post_layernorm", False):
        raise MemkitError(f"{c.source}: a ChatGLM config with pre_seq_len (P-tuning prefix) or "
                          "apply_residual_connection_post_layernorm has no mapping in memkit; pass "
                          "--trust-remote-code with the model folder to trace its own code")
    h, n_layers, n_heads, inter, vocab = c.need("hidden_size", "num_layers", "num_attention_heads",
                                                "ffn_hidden_size", "padded_vocab_size")
    hd = c.pos_int("kv_channels", 128)
    n_kv = c.pos_int("multi_query_group_num", 1) if c.flag("multi_query_attention", False) else n_heads
    if n_heads % n_kv:  # SelfAttention expands each group to heads // multi_query_group_num heads
        raise MemkitError(f"{c.source}: num_attention_heads={n_heads} is not a multiple of "
                          f"multi_query_group_num={n_kv}; fix the config")
    bias = c.flag("add_bias_linear", False)
    linears = (_lin("query_key_value", h, (n_heads + 2 * n_kv) * hd, bias or c.flag("add_qkv_bias", False), "qkv",
                    "column"),
               _lin("dense", n_heads * hd, h, bias, "o", "row"),
               _lin("dense_h_to_4h", h, 2 * inter, bias, "gate_up", "column"),
               _lin("dense_4h_to_h", inter, h, bias, "down", "row"))
    rms = c.flag("rmsnorm", True)
    norm = h if rms else 2 * h
    final = norm if c.flag("post_layer_norm", True) else 0
    return _common(
        c, architecture="ChatGLMForConditionalGeneration", kind="decoder", num_layers=n_layers, hidden_size=h,
        num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=hd, intermediate_size=inter,
        vocab_size=vocab, max_position_embeddings=c.pos_int("seq_length", 2048), hidden_act="silu",
        gated_mlp=True, norm_type="rmsnorm" if rms else "layernorm", position_embedding="rope",
        attention_dropout=c.num("attention_dropout", 0.0), hidden_dropout=c.num("hidden_dropout", 0.0),
        tie_word_embeddings=False, layer_linears=linears, embedding_params=vocab * h,
        layer_params=_sum(linears) + 2 * norm, head_params=final + vocab * h,
        # RotaryEmbedding(rotary_dim // 2) rotates half of each head; rope_ratio scales its base (GLM-4)
        extra={"partial_rotary_factor": 0.5, "rope_ratio": c.num("rope_ratio", 1.0)},
        # CoreAttention eager branch: softmax in fp32 when attention_softmax_in_fp32 or query-key layer scaling
        block=Block(softmax_fp32=c.flag("attention_softmax_in_fp32", True)
                    or c.flag("apply_query_key_layer_scaling", True)))


def _baichuan(c):
    """Baichuan-7B/13B and Baichuan2-7B/13B (model_type 'baichuan'; baichuan-inc/Baichuan2-13B-Chat
    modeling_baichuan.py): BaichuanAttention.W_pack = Linear(H, 3H, bias=False), o_proj = Linear(H, H,
    bias=False); MLP gate_proj, up_proj = Linear(H, I), down_proj = Linear(I, H), no bias, act_fn(gate) * up;
    BaichuanLayer input_layernorm, post_attention_layernorm and BaichuanModel.norm are RMSNorm (weight);
    embed_tokens (V, H); lm_head (Baichuan2's NormHead: a (V, H) weight, normalized in training) untied.
    Rotary or ALiBi: vllm-project/vllm vllm/model_executor/models/baichuan.py BaichuanForCausalLM (rope when
    hidden_size == 4096, the 7B models, else ALiBi) and BaiChuanForCausalLM (Baichuan-7B, rope). The 7B code
    runs xformers or SDPA (fused); the ALiBi (13B) code runs a fused kernel with the ALiBi mask only when
    xformers is installed, else matmul + mask + softmax in the scores' dtype (BaichuanAttention.forward)."""
    h, n_layers, n_heads, inter, vocab = c.need("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                "intermediate_size", "vocab_size")
    if h % n_heads:  # BaichuanAttention.__init__ raises the same
        raise MemkitError(f"{c.source}: hidden_size={h} is not divisible by num_attention_heads={n_heads}; "
                          "fix the config")
    archs = c.get("architectures", default=[]) or []
    alibi = h != 4096 and "BaiChuanForCausalLM" not in archs
    linears = (_lin("W_pack", h, 3 * h, False, "qkv", "column"), _lin("o_proj", h, h, False, "o", "row"))
    linears += _gated_mlp(h, inter, False)
    return _common(
        c, architecture="BaichuanForCausalLM", kind="decoder", num_layers=n_layers, hidden_size=h,
        num_attention_heads=n_heads, num_key_value_heads=n_heads, head_dim=h // n_heads, intermediate_size=inter,
        vocab_size=vocab, max_position_embeddings=c.pos_int("max_position_embeddings", 4096, "model_max_length"),
        hidden_act=c.get("hidden_act", default="silu"), gated_mlp=True, norm_type="rmsnorm",
        position_embedding="alibi" if alibi else "rope", attention_dropout=0.0, hidden_dropout=0.0,
        tie_word_embeddings=False, layer_linears=linears, embedding_params=vocab * h,
        layer_params=_sum(linears) + 2 * h, head_params=h + vocab * h,
        extra={"z_loss_weight": c.num("z_loss_weight", 0.0)},
        # the ALiBi models' attention without xformers: matmul, + mask, softmax (scores' dtype), matmul
        block=Block(sdpa=False) if alibi else Block())


def _internlm2(c):
    """InternLM2 / InternLM2.5 (model_type 'internlm2', InternLM2ForCausalLM; internlm/internlm2-7b
    modeling_internlm2.py): InternLM2Attention.wqkv = Linear(H, (heads + 2 * kv_heads) * head_dim, bias=
    config.bias), wo = Linear(H, H, bias=config.bias), head_dim = H // heads; InternLM2MLP w1 (gate), w3 (up)
    = Linear(H, I), w2 = Linear(I, H), no bias, w2(act(w1(x)) * w3(x)); attention_norm, ffn_norm and
    InternLM2Model.norm are RMSNorm (weight); tok_embeddings (V, H); output = Linear(H, V, bias=False).
    INTERNLM2_ATTENTION_CLASSES: 'eager' (repeat_kv, softmax(..., dtype=float32)) or 'flash_attention_2', as
    config.attn_implementation says. InternLM2Config defaults: bias true, num_key_value_heads = heads,
    attn_implementation 'eager', tie_word_embeddings false."""
    h, n_layers, n_heads, inter, vocab = c.need("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                "intermediate_size", "vocab_size")
    if h % n_heads:  # InternLM2Attention.__init__ raises the same
        raise MemkitError(f"{c.source}: hidden_size={h} is not divisible by num_attention_heads={n_heads}; "
                          "fix the config")
    n_kv, hd = c.heads(n_heads), h // n_heads
    bias = c.flag("bias", True)
    linears = (_lin("wqkv", h, (n_heads + 2 * n_kv) * hd, bias, "qkv", "column"), _lin("wo", h, h, bias, "o", "row"))
    linears += _gated_mlp(h, inter, False, names=("w1", "w3", "w2"))
    tie = c.flag("tie_word_embeddings", False)
    flash = c.get("attn_implementation", default="eager") == "flash_attention_2"
    return _common(
        c, architecture="InternLM2ForCausalLM", kind="decoder", num_layers=n_layers, hidden_size=h,
        num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=hd, intermediate_size=inter,
        vocab_size=vocab, max_position_embeddings=c.pos_int("max_position_embeddings", 2048),
        hidden_act=c.get("hidden_act", default="silu"), gated_mlp=True, norm_type="rmsnorm",
        position_embedding="rope", attention_dropout=0.0, hidden_dropout=0.0, tie_word_embeddings=tie,
        layer_linears=linears, embedding_params=vocab * h, layer_params=_sum(linears) + 2 * h,
        head_params=h + (0 if tie else vocab * h),
        # the model code has no SDPA path: eager attention unless the config asks for flash_attention_2
        block=Block(softmax_fp32=True, sdpa=flash))


def _internlm(c):
    """InternLM (v1, model_type 'internlm', InternLMForCausalLM; InternLM/InternLM tools/transformers/
    internlm_model/modeling_internlm.py): the Llama block with q/k/v/o_proj bias=config.bias and every head's
    own K/V (InternLMAttention ignores num_key_value_heads), gate/up/down_proj without bias, RMSNorm, lm_head
    Linear(H, V, bias=False); eager attention only, softmax(..., dtype=float32). InternLMConfig defaults:
    bias true, tie_word_embeddings false, max_position_embeddings 2048."""
    bias = c.flag("bias", True)
    mha = _Cfg({**c.data, "num_key_value_heads": None}, c.source)  # InternLMAttention: k/v_proj H -> H
    return _llama_like(mha, architecture="InternLMForCausalLM", hidden_act=c.get("hidden_act", default="silu"),
                       tie_default=False, q_bias=bias, o_bias=bias, block=Block(softmax_fp32=True, sdpa=False))


_WHY = "ships remote code memkit does not run"
REMOTE_FAMILIES = {
    "qwen": (_qwen1, "a Llama-style decoder with the config's sizes (fused c_attn q/k/v with bias, SwiGLU MLP "
                     f"of intermediate_size/2 per branch, RMSNorm, untied head) because model_type 'qwen' "
                     f"(QWenLMHeadModel) {_WHY}"),
    "chatglm": (_chatglm, "a Llama-style decoder with the config's sizes (fused query_key_value with "
                          "multi_query_group_num K/V heads, fused SwiGLU dense_h_to_4h, RMSNorm, untied head; "
                          "its K/V copies expanded to every head are not priced) because model_type 'chatglm' "
                          f"(ChatGLMForConditionalGeneration) {_WHY}"),
    "baichuan": (_baichuan, "a Llama-style decoder with the config's sizes (fused W_pack q/k/v, SwiGLU MLP, RMSNorm, "
                            "untied head; rope at hidden_size 4096, else ALiBi with eager attention, its ALiBi mask "
                            "and NormHead's normalized weight copy not priced) because model_type 'baichuan' "
                            f"(BaichuanForCausalLM) {_WHY}"),
    "internlm": (_internlm, "a Llama-style decoder with the config's sizes (q/k/v/o_proj with config.bias, SwiGLU MLP, "
                            "RMSNorm, untied head, eager attention) because model_type 'internlm' "
                            f"(InternLMForCausalLM) {_WHY}"),
    "internlm2": (_internlm2, "a Llama-style decoder with the config's sizes (fused wqkv with GQA, SwiGLU w1/w3/w2, "
                              "RMSNorm, eager attention unless attn_implementation is flash_attention_2) because "
                              f"model_type 'internlm2' (InternLM2ForCausalLM) {_WHY}"),
}
"""model_type -> (the family's fields, what it is priced as and why): remote-code families memkit maps
without running their code. Others need --trust-remote-code (spec/generic.py)."""


# ---------------------------------------------------------------- decoder families, LayerNorm

def _phi(c):
    """phi/modeling_phi.py: one LayerNorm per block, attention and MLP in parallel, biased Linears and LM head."""
    h, n_layers, n_heads, inter, vocab = c.need("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                "intermediate_size", "vocab_size")
    n_kv = c.heads(n_heads)
    hd = c.head_dim(h, n_heads)
    linears = _attention(h, n_heads, n_kv, hd, qkv_bias=True, o_bias=True,
                         names=("q_proj", "k_proj", "v_proj", "dense")) + _mlp(h, inter, True)
    qk_norm = 2 * 2 * (h // n_heads) if c.flag("qk_layernorm", False) else 0  # LayerNorm weight + bias
    tie = c.flag("tie_word_embeddings", False)
    # lm_head = nn.Linear(H, V, bias=True): tying shares the weight, the bias stays.
    head = 2 * h + vocab + (0 if tie else vocab * h)
    return _common(
        c, architecture="PhiForCausalLM", kind="decoder", num_layers=n_layers, hidden_size=h,
        num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=hd, intermediate_size=inter,
        vocab_size=vocab, max_position_embeddings=c.pos_int("max_position_embeddings", 2048),
        hidden_act=c.get("hidden_act", default="gelu_new"), gated_mlp=False, norm_type="layernorm",
        position_embedding="rope", attention_dropout=c.num("attention_dropout", 0.0),
        hidden_dropout=c.num("resid_pdrop", 0.0), tie_word_embeddings=tie, parallel_attn_mlp=True,
        block=Block(softmax_fp32=True),  # phi/modeling_phi.py eager: softmax(..., dtype=torch.float32)
        layer_linears=linears, embedding_params=vocab * h, layer_params=_sum(linears) + 2 * h + qk_norm,
        head_params=head, extra={"embedding_dropout": c.num("embd_pdrop", 0.0)})


def _gpt2(c):
    """gpt2/modeling_gpt2.py: learned positions, Conv1D (a transposed Linear) everywhere, tied LM head."""
    h, n_layers, n_heads, vocab = c.need(("n_embd", "hidden_size"), ("n_layer", "num_hidden_layers"),
                                         ("n_head", "num_attention_heads"), "vocab_size")
    n_pos = c.pos_int("n_positions", 1024, "max_position_embeddings")
    inter = c.pos_int("n_inner", 4 * h)
    linears = (_lin("c_attn", h, 3 * h, True, "qkv", "column"), _lin("c_proj", h, h, True, "o", "row"),
               _lin("c_fc", h, inter, True, "up", "column"), _lin("c_proj", inter, h, True, "down", "row"))
    norms = 2 * 2 * h
    if c.flag("add_cross_attention", False):  # GPT2Block: crossattention (c_attn H->2H, q_attn, c_proj) + ln
        linears += (_lin("c_attn", h, 2 * h, True, "kv", "column"), _lin("q_attn", h, h, True, "q", "column"),
                    _lin("c_proj", h, h, True, "o", "row"))
        norms += 2 * h
    tie = c.flag("tie_word_embeddings", True)
    return _common(
        c, architecture="GPT2LMHeadModel", kind="decoder", num_layers=n_layers, hidden_size=h,
        num_attention_heads=n_heads, num_key_value_heads=n_heads, head_dim=h // n_heads, intermediate_size=inter,
        vocab_size=vocab, max_position_embeddings=n_pos, hidden_act=c.get("activation_function", default="gelu_new"),
        gated_mlp=False, norm_type="layernorm", position_embedding="learned",
        attention_dropout=c.num("attn_pdrop", 0.1), hidden_dropout=c.num("resid_pdrop", 0.1),
        tie_word_embeddings=tie, layer_linears=linears, embedding_params=vocab * h + n_pos * h,
        layer_params=_sum(linears) + norms, head_params=2 * h + (0 if tie else vocab * h),
        extra={"embedding_dropout": c.num("embd_pdrop", 0.1)})


def _opt(c):
    """opt/modeling_opt.py: learned positions offset by 2, optional project_in/out when word_embed_proj_dim != H."""
    h, n_layers, n_heads, inter, vocab = c.need("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                "ffn_dim", "vocab_size")
    n_pos = c.pos_int("max_position_embeddings", 2048)
    proj = c.pos_int("word_embed_proj_dim", h)
    bias = c.flag("enable_bias", True)
    ln = 2 * h if c.flag("layer_norm_elementwise_affine", True) else 0
    linears = _attention(h, n_heads, n_heads, h // n_heads, qkv_bias=bias, o_bias=bias,
                         names=("q_proj", "k_proj", "v_proj", "out_proj")) + _mlp(h, inter, bias)
    final_ln = ln if c.flag("do_layer_norm_before", True) and not c.flag("_remove_final_layer_norm", False) else 0
    project = proj * h if proj != h else 0  # project_in / project_out, no bias
    tie = c.flag("tie_word_embeddings", True)
    return _common(
        c, architecture="OPTForCausalLM", kind="decoder", num_layers=n_layers, hidden_size=h,
        num_attention_heads=n_heads, num_key_value_heads=n_heads, head_dim=h // n_heads, intermediate_size=inter,
        vocab_size=vocab, max_position_embeddings=n_pos, hidden_act=c.get("activation_function", default="relu"),
        gated_mlp=False, norm_type="layernorm", position_embedding="learned",
        attention_dropout=c.num("attention_dropout", 0.0), hidden_dropout=c.num("dropout", 0.1),
        tie_word_embeddings=tie, layer_linears=linears,
        embedding_params=vocab * proj + (n_pos + 2) * h + project,  # OPTLearnedPositionalEmbedding: offset 2
        layer_params=_sum(linears) + 2 * ln, head_params=final_ln + project + (0 if tie else vocab * proj),
        extra={"word_embed_proj_dim": proj})


def _bloom(c):
    """bloom/modeling_bloom.py: ALiBi, a LayerNorm right after the word embeddings, MLP width 4H."""
    h, n_layers, n_heads, vocab = c.need(("hidden_size", "n_embed"), ("n_layer", "num_hidden_layers"),
                                         ("n_head", "num_attention_heads"), "vocab_size")
    linears = (_lin("query_key_value", h, 3 * h, True, "qkv", "column"), _lin("dense", h, h, True, "o", "row"),
               _lin("dense_h_to_4h", h, 4 * h, True, "up", "column"),
               _lin("dense_4h_to_h", 4 * h, h, True, "down", "row"))
    tie = c.flag("tie_word_embeddings", True)
    return _common(
        c, architecture="BloomForCausalLM", kind="decoder", num_layers=n_layers, hidden_size=h,
        num_attention_heads=n_heads, num_key_value_heads=n_heads, head_dim=h // n_heads, intermediate_size=4 * h,
        vocab_size=vocab, max_position_embeddings=c.pos_int("seq_length", 2048, "max_position_embeddings"),
        hidden_act="bloom_gelu", gated_mlp=False, norm_type="layernorm", position_embedding="alibi",
        # BloomAttention: no SDPA path in transformers 5; softmax(..., dtype=torch.float32).to(input_dtype)
        block=Block(sdpa=False, softmax_fp32=True),
        attention_dropout=c.num("attention_dropout", 0.0), hidden_dropout=c.num("hidden_dropout", 0.0),
        tie_word_embeddings=tie, layer_linears=linears, embedding_params=vocab * h + 2 * h,
        layer_params=_sum(linears) + 2 * 2 * h, head_params=2 * h + (0 if tie else vocab * h))


def _falcon(c):
    """falcon/modeling_falcon.py: fused QKV (multi-query or GQA), parallel attention/MLP, tied head."""
    h, n_layers, n_heads, vocab = c.need(("hidden_size", "n_embed"), "num_hidden_layers", "num_attention_heads",
                                         "vocab_size")
    hd = h // n_heads
    new_arch = c.flag("new_decoder_architecture", False)
    multi_query = c.flag("multi_query", True)
    parallel = c.flag("parallel_attn", True)
    bias = c.flag("bias", False)
    inter = c.pos_int("ffn_hidden_size", 4 * h)
    if new_arch:  # FalconAttention: qkv_out_dim = (2 * num_kv_heads + num_heads) * head_dim
        n_kv = c.heads(n_heads, kv_key="num_kv_heads")
    else:
        n_kv = 1 if multi_query else n_heads
    linears = (_lin("query_key_value", h, (n_heads + 2 * n_kv) * hd, bias, "qkv", "column"),
               _lin("dense", h, h, bias, "o", "row"),
               _lin("dense_h_to_4h", h, inter, bias, "up", "column"),
               _lin("dense_4h_to_h", inter, h, bias, "down", "row"))
    n_ln = c.get("num_ln_in_parallel_attn", default=2 if new_arch else 1)  # FalconDecoderLayer.__init__
    n_ln = 2 if not parallel else (2 if n_ln == 2 else 1)
    tie = c.flag("tie_word_embeddings", True)
    alibi = c.flag("alibi", False)
    return _common(
        c, architecture="FalconForCausalLM", kind="decoder", num_layers=n_layers, hidden_size=h,
        num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=hd, intermediate_size=inter,
        vocab_size=vocab, max_position_embeddings=c.pos_int("max_position_embeddings", 2048),
        hidden_act=c.get("activation", default="gelu"), gated_mlp=False, norm_type="layernorm",
        position_embedding="alibi" if alibi else "rope", attention_dropout=c.num("attention_dropout", 0.0),
        hidden_dropout=c.num("hidden_dropout", 0.0), tie_word_embeddings=tie,
        # FalconAttention (sdpa branch): multi-query passes one K/V head to SDPA without enable_gqa.
        block=Block(sdpa_kv_broadcast=not new_arch and multi_query, parallel_norms=n_ln if parallel else 1),
        parallel_attn_mlp=parallel, layer_linears=linears, embedding_params=vocab * h,
        layer_params=_sum(linears) + n_ln * 2 * h, head_params=2 * h + (0 if tie else vocab * h))


def _gpt_neox(c):
    """gpt_neox/modeling_gpt_neox.py: fused QKV, two LayerNorms, parallel residual, partial rotary, untied head."""
    h, n_layers, n_heads, inter, vocab = c.need("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                "intermediate_size", "vocab_size")
    bias = c.flag("attention_bias", True)
    linears = (_lin("query_key_value", h, 3 * h, bias, "qkv", "column"), _lin("dense", h, h, bias, "o", "row"),
               _lin("dense_h_to_4h", h, inter, True, "up", "column"),
               _lin("dense_4h_to_h", inter, h, True, "down", "row"))
    tie = c.flag("tie_word_embeddings", False)
    return _common(
        c, architecture="GPTNeoXForCausalLM", kind="decoder", num_layers=n_layers, hidden_size=h,
        num_attention_heads=n_heads, num_key_value_heads=n_heads, head_dim=h // n_heads, intermediate_size=inter,
        vocab_size=vocab, max_position_embeddings=c.pos_int("max_position_embeddings", 2048),
        hidden_act=c.get("hidden_act", default="gelu"), gated_mlp=False, norm_type="layernorm",
        position_embedding="rope", attention_dropout=c.num("attention_dropout", 0.0),
        hidden_dropout=c.num("hidden_dropout", 0.0), tie_word_embeddings=tie,
        # x + attn(ln1(x)) + mlp(ln2(x)): both branches read the block input (GPTNeoXLayer.forward)
        parallel_attn_mlp=c.flag("use_parallel_residual", True), layer_linears=linears,
        # gpt_neox/modeling_gpt_neox.py: eager softmax(..., dtype=float32); parallel residual x + attn(ln1(x))
        # + mlp(ln2(x)), two norms of the same input
        block=Block(softmax_fp32=True, parallel_norms=2),
        embedding_params=vocab * h, layer_params=_sum(linears) + 2 * 2 * h,
        head_params=2 * h + (0 if tie else vocab * h))


# ---------------------------------------------------------------- encoders and encoder-decoders

def _bert_like(c, *, architecture):
    """bert/modeling_bert.py (BertForMaskedLM: BertModel without pooler + BertLMPredictionHead);
    roberta/modeling_roberta.py has the same parameters (RobertaLMHead)."""
    h, n_layers, n_heads, inter, vocab = c.need("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                "intermediate_size", "vocab_size")
    if c.flag("add_cross_attention", False) or c.flag("is_decoder", False):
        raise MemkitError(f"{c.source}: a {c.model_type} decoder (is_decoder/add_cross_attention) is not "
                          "supported; memkit estimates masked-LM training of the encoder")
    n_pos = c.pos_int("max_position_embeddings", 512)  # BertConfig / RobertaConfig defaults
    n_types = c.pos_int("type_vocab_size", 2)
    linears = _attention(h, n_heads, n_heads, h // n_heads, qkv_bias=True, o_bias=True,
                         names=("query", "key", "value", "dense")) + _mlp(h, inter, True, names=("dense", "dense"))
    tie = c.flag("tie_word_embeddings", True)
    # MLM head: transform dense (H*H + H) + LayerNorm (2H) + output bias (V); decoder weight tied to the word
    # embeddings; untied, the decoder owns its own weight and bias (the bias is tied only with the weights).
    head = h * h + h + 2 * h + vocab + (0 if tie else vocab * h + vocab)
    return _common(
        c, architecture=architecture, kind="encoder", num_layers=n_layers, hidden_size=h,
        num_attention_heads=n_heads, num_key_value_heads=n_heads, head_dim=h // n_heads, intermediate_size=inter,
        vocab_size=vocab, max_position_embeddings=n_pos, hidden_act=c.get("hidden_act", default="gelu"),
        gated_mlp=False, norm_type="layernorm", position_embedding="learned",
        attention_dropout=c.num("attention_probs_dropout_prob", 0.1), hidden_dropout=c.num("hidden_dropout_prob", 0.1),
        tie_word_embeddings=tie, layer_linears=linears, block=Block(norm_placement="post"),
        embedding_params=vocab * h + n_pos * h + n_types * h + 2 * h,  # word, position, token type, LayerNorm
        layer_params=_sum(linears) + 2 * 2 * h, head_params=head)


def _bert(c):
    return _bert_like(c, architecture="BertForMaskedLM")


def _roberta(c):
    return _bert_like(c, architecture="RobertaForMaskedLM")


def _t5(c):
    """t5/modeling_t5.py (T5ForConditionalGeneration): shared embedding, bias-free Linears, T5LayerNorm (an RMS
    norm, weight only), a relative-position bias table in block 0 of each stack, a final norm per stack.

    The tables (relative_attention_num_buckets x num_heads, one per stack) are counted in embedding_params, so
    every block of a stack has the same layer_params. tie_word_embeddings=false (T5 v1.1, Flan-T5) is taken as
    the checkpoint has it: an untied lm_head. transformers 5 forces T5Config.tie_word_embeddings=True (it keeps
    the old flag as scale_decoder_outputs), so from_config ties lm_head, but from_pretrained of such a
    checkpoint finds a different lm_head.weight and leaves it untied (modeling_utils.tie_weights).
    """
    h, n_enc, n_heads, d_ff, vocab = c.need(("d_model", "hidden_size"), ("num_layers", "num_hidden_layers"),
                                            ("num_heads", "num_attention_heads"), "d_ff", "vocab_size")
    hd = c.pos_int("d_kv", 64, "head_dim")
    n_dec = c.pos_int("num_decoder_layers", n_enc)
    proj = c.get("feed_forward_proj", default="relu")
    gated = proj.startswith("gated-")
    act = proj.split("-")[-1]
    act = "gelu_new" if proj == "gated-gelu" else act  # T5Config.__post_init__
    names = ("q", "k", "v", "o")
    ff = (_gated_mlp(h, d_ff, False, names=("wi_0", "wi_1", "wo")) if gated
          else _mlp(h, d_ff, False, names=("wi", "wo")))
    attn = _attention(h, n_heads, n_heads, hd, qkv_bias=False, o_bias=False, names=names)
    enc = attn + ff
    dec = attn + _attention(h, n_heads, n_heads, hd, qkv_bias=False, o_bias=False, names=names) + ff
    buckets = c.pos_int("relative_attention_num_buckets", 32)
    tie = c.flag("tie_word_embeddings", True)
    dropout = c.num("dropout_rate", 0.1)
    return _common(
        c, architecture="T5ForConditionalGeneration", kind="encoder-decoder", num_layers=n_dec,
        num_encoder_layers=n_enc, hidden_size=h, num_attention_heads=n_heads, num_key_value_heads=n_heads,
        head_dim=hd, intermediate_size=d_ff, vocab_size=vocab,
        max_position_embeddings=c.pos_int("n_positions", 512), hidden_act=act, gated_mlp=gated, norm_type="rmsnorm",
        position_embedding="relative", attention_dropout=dropout, hidden_dropout=dropout, tie_word_embeddings=tie,
        # t5/modeling_t5.py: the position bias (an nn.Embedding) is added to the scores as SDPA's mask;
        # T5DenseActDense / T5DenseGatedActDense drop out before wo.
        block=Block(attn_bias_grad=True, ffn_dropout=True),
        layer_linears=dec, encoder_layer_linears=enc,
        embedding_params=vocab * h + 2 * buckets * n_heads,
        layer_params=_sum(dec) + 3 * h, encoder_layer_params=_sum(enc) + 2 * h,
        head_params=2 * h + (0 if tie else vocab * h),  # encoder and decoder final_layer_norm, untied lm_head
        extra={"relative_attention_num_buckets": buckets,
               "relative_attention_max_distance": c.get("relative_attention_max_distance", default=128)})


# ---------------------------------------------------------------- dispatch

_FAMILIES = {
    "llama": _llama, "mistral": _mistral, "mixtral": _mixtral, "qwen2": _qwen2, "qwen3": _qwen3,
    "gemma": _gemma, "gemma2": _gemma2, "gemma3_text": _gemma3_text, "phi": _phi, "phi3": _phi3,
    "gpt2": _gpt2, "opt": _opt, "bloom": _bloom, "falcon": _falcon, "gpt_neox": _gpt_neox,
    "bert": _bert, "roberta": _roberta, "t5": _t5,
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_FAMILIES))


def spec_from_config(config: dict, *, name: str, hub_id: str = "", config_path: str = "",
                     auto_class: str | None = None, traced: bool = False,
                     trust_remote_code: bool = False) -> ModelSpec:
    """A ModelSpec from the dict of a config.json (`name` is what the user called it). `auto_class`
    (a task head) or `traced`: counted and traced from transformers' module (spec/generic.py) even
    for a family modelled by hand. `trust_remote_code` (--trust-remote-code): a config with an
    `auto_map` is built from its folder's own code and traced, as transformers runs it then; without
    it a remote-code family is priced by its mapping (REMOTE_FAMILIES) or refused (spec/generic.py)."""
    source = config_path or name
    model_type = config.get("model_type")
    if not model_type:
        raise MemkitError(f"{source} has no model_type; is it a Hugging Face config.json? "
                          f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == "gemma3" and isinstance(config.get("text_config"), dict):
        raise MemkitError(f"{source} is a multimodal gemma3 config; memkit estimates its language model: save "
                          "its text_config (model_type gemma3_text) as a config.json and pass that")
    family = _FAMILIES.get(model_type)
    if trust_remote_code and isinstance(config.get("auto_map"), dict):
        config = _with_remote_code(config, source, config_path)
        family = None
    elif family is None and model_type in REMOTE_FAMILIES and not (auto_class or traced):
        mapped, priced_as = REMOTE_FAMILIES[model_type]
        fields = mapped(_Cfg(config, source))
        fields["extra"]["approximations"] = (
            f"priced as {priced_as}; pass --trust-remote-code to build and trace the model's own code",)
        return _spec(fields, name=name, model_type=model_type, hub_id=hub_id, config_path=config_path)
    if family is None or auto_class or traced:
        block = family(_Cfg(config, source)).get("block") if family is not None else None
        # Not modelled by hand: sizes from transformers' config class, counts from a meta-device build,
        # activations traced from the module itself (spec/generic.py, estimate/traced.py).
        from memkit.spec.generic import generic_fields

        fields = generic_fields(config, source, auto_class)
        if block is not None:  # a hand-modelled family's block facts (T5's position bias: activations.py)
            fields["block"] = block
    else:
        fields = family(_Cfg(config, source))
        # the config itself, for a task head built from it (spec/generic.py task_spec)
        fields["extra"] = {**fields.get("extra", {}), "source_config": json.dumps(config, sort_keys=True)}
    return _spec(fields, name=name, model_type=model_type, hub_id=hub_id, config_path=config_path)


def _with_remote_code(config: dict, source: str, config_path: str) -> dict:
    """`config` marked to be built by its folder's own code (spec/hf_config.py REMOTE_CODE_KEY)."""
    from memkit.spec.hf_config import REMOTE_CODE_KEY

    if not config_path:
        raise MemkitError(f"--trust-remote-code: {source} is not a config.json in a model folder; pass the "
                          "folder that holds its config.json and the modeling_*.py its auto_map names")
    return {**config, REMOTE_CODE_KEY: str(Path(config_path).parent)}


def _spec(fields: dict, *, name: str, model_type: str, hub_id: str, config_path: str) -> ModelSpec:
    num_params = (fields["embedding_params"] + fields["num_layers"] * fields["layer_params"]
                  + fields.get("num_encoder_layers", 0) * fields.get("encoder_layer_params", 0)
                  + fields["head_params"])
    return ModelSpec(name=name, model_type=model_type, num_params=num_params, hub_id=hub_id,
                     config_path=config_path, **fields)
