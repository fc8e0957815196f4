"""A ModelSpec for any model_type transformers can build, hand-modelled in hf.py or not.

Sizes come from transformers' own config class (its attribute_map resolves n_embd/d_model/...
to the standard names), parameter counts and linears from the model built on the meta device
(exact by construction: accelerate's init_empty_weights idea), and the activations from the
traced path (estimate/traced.py), which `ModelSpec.traced` switches on. A config whose
model_type transformers does not know ships its own code: spec/hf.py prices the families it maps
(REMOTE_FAMILIES) without running it; the others are built from the model folder's code only under
--trust-remote-code (spec/hf_config.py REMOTE_CODE_KEY), and refused in one line otherwise.
Imports torch/transformers lazily, only when hf.py meets a model type it does not model by hand.
"""
from __future__ import annotations

import json
from functools import lru_cache

from memkit.errors import MemkitError
from memkit.spec.model import Linear

_ROLES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "query": "q", "key": "k", "value": "v",
          "gate_proj": "gate", "up_proj": "up", "down_proj": "down", "qkv_proj": "qkv", "c_attn": "qkv",
          "query_key_value": "qkv", "Wqkv": "qkv", "fc1": "up", "fc2": "down", "fc_in": "up", "fc_out": "down",
          "c_fc": "up", "dense_h_to_4h": "up", "dense_4h_to_h": "down", "out_proj": "o", "dense": "o"}
# Megatron-LM split of each role (Shoeybi et al. 2019, Sec. 3), as hf.py's _lin uses it.
_TP = {"q": "column", "k": "column", "v": "column", "qkv": "column", "gate": "column", "up": "column",
       "o": "row", "down": "row"}


def generic_fields(config: dict, source: str, auto_class: str | None = None) -> dict:
    """ModelSpec fields (hf.spec_from_config adds name and num_params) for `config`, built as its
    language model or as `auto_class` (a task head: spec/hf_config.py TASK_CLASSES)."""
    from memkit.spec.hf_config import (REMOTE_CODE_KEY, auto_class_for, block_lists, build_config,
                                       peft_saved_params)

    if REMOTE_CODE_KEY not in config and not _known_to_transformers(config["model_type"]):
        _refuse_remote_code(config, source)
    hf_config = build_config(config)
    lm_class = auto_class_for(hf_config)
    auto_class = auto_class or lm_class
    model = _meta_model(hf_config, auto_class)
    lists = block_lists(model)
    if not lists:
        raise MemkitError(f"{source}: found no repeated blocks in {type(model).__name__}; memkit cannot "
                          "price its activations")
    decoder_name, decoder = next(((n, m) for n, m in lists if "decoder" in n), max(lists, key=lambda x: len(x[1])))
    encoder = next((m for n, m in lists if n != decoder_name), None)
    numel = _numel
    total = numel(model)
    n_layers = len(decoder)
    layer_params = sum(numel(b) for b in decoder) // n_layers
    n_enc = len(encoder) if encoder is not None else 0
    enc_params = sum(numel(b) for b in encoder) // n_enc if n_enc else 0
    embed = model.get_input_embeddings()
    embedding_params = numel(embed) if embed is not None else 0
    head_params = total - embedding_params - n_layers * layer_params - n_enc * enc_params
    biggest = max(decoder, key=numel)
    h = _attr(hf_config, "hidden_size", default=None) or embed.weight.shape[1]
    heads = _attr(hf_config, "num_attention_heads", default=1)
    kv = _attr(hf_config, "num_key_value_heads", "num_kv_heads", default=None) or heads
    kind = {"AutoModelForCausalLM": "decoder", "AutoModelForSeq2SeqLM": "encoder-decoder",
            "AutoModelForMaskedLM": "encoder"}[lm_class]
    linears = _linears(biggest)
    names = {type(m).__name__.lower() for m in model.modules()}
    head_out = model.get_output_embeddings()
    tie = head_out is not None and embed is not None and head_out.weight is embed.weight
    experts = _attr(hf_config, "num_experts", "num_local_experts", "n_routed_experts", default=0) or 0
    return dict(
        architecture=type(model).__name__, kind=kind, num_layers=n_layers, num_encoder_layers=n_enc,
        hidden_size=h, num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=_attr(hf_config, "head_dim", default=None) or h // heads,
        intermediate_size=_attr(hf_config, "intermediate_size", "moe_intermediate_size", "ffn_dim", "n_inner",
                                "d_ff", default=None) or 4 * h,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=_attr(hf_config, "max_position_embeddings", "n_positions", default=1 << 20),
        hidden_act=str(_attr(hf_config, "hidden_act", "activation_function", "hidden_activation",
                             default="unknown")),
        gated_mlp=any(lin.role == "gate" for lin in linears), norm_type="rmsnorm" if any("rmsnorm" in n for n in names)
        else "layernorm", position_embedding="rope" if any("rotary" in n for n in names) else "learned",
        num_experts=experts, num_experts_per_tok=_attr(hf_config, "num_experts_per_tok", "top_k", default=0) or 0,
        tie_word_embeddings=tie, layer_linears=linears,
        encoder_layer_linears=_linears(encoder[0]) if n_enc else (), embedding_params=embedding_params,
        layer_params=layer_params, encoder_layer_params=enc_params, head_params=head_params,
        lora_saved_params=peft_saved_params(model, auto_class),
        head_matmul_params=_head_matmul_params(model, lists) if auto_class != lm_class else 0,
        linear_in_out=_linear_in_out(model),
        traced=True, extra={"traced_config": json.dumps(config, sort_keys=True), "auto_class": auto_class,
                            "approximations": tuple(
                                f"tensor-parallel splits: {', '.join(unknown)} priced as replicated (not in "
                                "memkit's role table)" for unknown in [sorted({
                                    lin.name for lin in linears if lin.role not in _TP and lin.role != "router"})]
                                if unknown)})


def task_spec(spec, plan):
    """`spec` as `plan` trains it: the same spec for the model's own LM at one length; else the model
    built with the task's head (a classifier of plan.num_labels outputs: transformers
    AutoModelForSequenceClassification / AutoModelForTokenClassification) or, with --target-len, the
    encoder-decoder traced at two lengths -- counted on the meta device and traced (estimate/traced.py)."""
    if plan.task == "causal-lm" and not plan.target_len:
        return spec
    if plan.target_len and spec.kind != "encoder-decoder":
        article = "an" if spec.kind == "encoder" else "a"
        raise MemkitError(f"--target-len {plan.target_len}: {spec.name} is {article} {spec.kind}, not an "
                          "encoder-decoder (T5, BART); drop --target-len and give its length as --seq-len")
    config = json.loads(spec.extra.get("traced_config") or spec.extra.get("source_config") or "null")
    if config is None:
        raise MemkitError(f"--task {plan.task}: {spec.name} has no config memkit can build a task head from; "
                          "use --task causal-lm")
    return _task_spec(json.dumps(config, sort_keys=True), spec.name, spec.hub_id, spec.config_path,
                      plan.task, plan.num_labels)


@lru_cache(maxsize=64)
def _task_spec(config_json: str, name: str, hub_id: str, config_path: str, task: str, num_labels: int):
    import transformers

    from memkit.spec.hf_config import TASK_CLASSES, build_config
    from memkit.spec.hf import spec_from_config

    config = json.loads(config_json)
    if task == "causal-lm":
        return spec_from_config(config, name=name, hub_id=hub_id, config_path=config_path, traced=True)
    config = {k: v for k, v in config.items() if k not in ("id2label", "label2id")}
    config["num_labels"] = num_labels
    auto_class = TASK_CLASSES[task]
    if type(build_config(config)) not in getattr(transformers, auto_class)._model_mapping:
        raise MemkitError(f"--task {task}: transformers {transformers.__version__} has no "
                          f"{auto_class.removeprefix('AutoModelFor')} class for model_type {config['model_type']!r}; "
                          "use --task causal-lm (its language-model head)")
    return spec_from_config(config, name=name, hub_id=hub_id, config_path=config_path, auto_class=auto_class)


def _known_to_transformers(model_type: str) -> bool:
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


def _refuse_remote_code(config: dict, source: str) -> None:
    """No transformers class and no mapping in spec/hf.py REMOTE_FAMILIES: the model's code ships with it,
    and memkit runs it only when asked (--trust-remote-code)."""
    import transformers

    from memkit.spec.hf import REMOTE_FAMILIES

    arch = ",".join(map(str, config.get("architectures") or [])) or "no architectures"
    raise MemkitError(f"{source}: model_type {config['model_type']!r} ({arch}) is not in transformers "
                      f"{transformers.__version__} and memkit has no mapping for it (mapped remote-code families: "
                      f"{', '.join(sorted(REMOTE_FAMILIES))}); pass --trust-remote-code with the model folder "
                      "(its config.json and modeling_*.py) to build and trace its own code, or a config of a "
                      "family memkit knows")


def _meta_model(hf_config, auto_class: str):
    import torch
    import transformers

    from memkit.spec.hf_config import remote_kwargs

    code = remote_kwargs(hf_config)
    try:
        with torch.device("meta"):
            return getattr(transformers, auto_class).from_config(hf_config, **code)
    except Exception as exc:
        if not code:
            raise
        # the model folder's own code, run as --trust-remote-code asked: any failure is its own
        raise MemkitError(f"--trust-remote-code: the model code of {hf_config.model_type!r} failed to build "
                          f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None


def _linear_in_out(model) -> tuple[tuple[str, int], ...]:
    """(name, sum of in + out features) of the model's nn.Linear modules, by last name part: the
    modules peft's target_modules match by name suffix (ModelSpec.lora_params)."""
    import torch

    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover
        Conv1D = ()
    out: dict[str, int] = {}
    for name, module in model.named_modules():
        key = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear):
            out[key] = out.get(key, 0) + module.in_features + module.out_features
        elif Conv1D and isinstance(module, Conv1D):  # GPT-2 style, weight (in, out): peft wraps it too
            out[key] = out.get(key, 0) + sum(module.weight.shape)
    return tuple(out.items())


def _head_matmul_params(model, lists) -> int:
    """Weights and biases of a task head's nn.Linear modules: those outside the blocks and the
    embeddings (BERT's pooler.dense and classifier, ELECTRA's classifier.dense / out_proj, DistilBERT's
    pre_classifier, a decoder's score; not ELECTRA's embeddings_project, which runs per token)."""
    import torch

    blocks = [name for name, _ in lists]
    return sum(_numel(m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               and not any(name.startswith(b + ".") for b in blocks) and "embed" not in name)


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _attr(cfg, *names, default):
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        if name.endswith("act") and isinstance(value, str):
            return value
    return default


def _linears(block) -> tuple[Linear, ...]:
    """Every Linear-like weight of one block under its HF leaf name (LoRA targets match it)."""
    import torch

    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover
        Conv1D = ()
    out = []
    for qual, mod in block.named_modules():
        leaf = qual.split(".")[-1]
        if isinstance(mod, torch.nn.Linear):
            rows = [(leaf, mod.in_features, mod.out_features, mod.bias is not None, 1)]
        elif Conv1D and isinstance(mod, Conv1D):  # GPT-2 style: weight is (in, out)
            rows = [(leaf, mod.weight.shape[0], mod.weight.shape[1], mod.bias is not None, 1)]
        elif type(mod).__name__.endswith("Router") and getattr(mod, "weight", None) is not None:
            rows = [(leaf, mod.weight.shape[1], mod.weight.shape[0], False, 1)]  # MoE router: (experts, hidden)
        else:  # fused MoE experts: 3-D (num_experts, out, in) parameters
            rows = [(f"{leaf}.{pname}", p.shape[2], p.shape[1], False, p.shape[0])
                    for pname, p in mod.named_parameters(recurse=False) if p.dim() == 3]
        for name, fin, fout, bias, count in rows:
            role = "router" if type(mod).__name__.endswith("Router") else _ROLES.get(
                name, "expert" if count > 1 else "other")
            out.append(Linear(name=name, in_features=int(fin), out_features=int(fout), bias=bias, role=role,
                              count=int(count), tp_style=_TP.get(role, "replicate")))
    return tuple(out)
