"""ModelSpec: the architecture facts the estimator needs, read once from an HF config (hf.py).

Frozen and free of torch/transformers, so config work is instant (memkit/ARCHITECTURE.md, "Conventions").
Parameter counts are exact: tests compare them with `sum(p.numel())` of the model
that transformers builds on the meta device.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class Linear:
    """One nn.Linear inside a transformer block."""

    name: str
    """Module name as HF spells it (q_proj, c_attn, dense_h_to_4h, ...); LoRA targets match it."""
    in_features: int
    out_features: int
    bias: bool
    role: str
    """What it does: q, k, v, qkv, o, up, gate, gate_up, down, router, expert_gate_up, expert_down
    (expert weights are 3-D parameters in transformers 5: name 'experts.gate_up_proj', count=num_experts)."""
    count: int = 1
    """How many copies per block (num_experts for expert weights)."""
    tp_style: str = "replicate"
    """Tensor-parallel split: 'column' (out_features split), 'row' (in_features split) or 'replicate'."""

    @property
    def num_params(self) -> int:
        return self.count * (self.in_features * self.out_features + (self.out_features if self.bias else 0))


@dataclass(frozen=True, slots=True, kw_only=True)
class Block:
    """How one block computes, as far as what autograd saves depends on it (set by spec/hf.py from the
    family's modeling file; the activation tape reads these instead of model_type names)."""

    norm_placement: str = "pre"
    """'pre' (Llama, GPT-2), 'post' (BERT: LayerNorm after each residual add) or 'sandwich'
    (Gemma 2/3: a norm before and after attention and MLP)."""
    rms_norm: str = "llama"
    """RMSNorm form: 'llama' (weight * normed.to(dtype)) or 'gemma' ((normed * (1 + weight)).type_as(x))."""
    qk_norm: bool = False
    """RMSNorm over head_dim on q and k (Qwen3, Gemma 3, OLMo 2)."""
    softmax_fp32: bool = False
    """Eager attention calls softmax(..., dtype=float32) (Llama-style) rather than in the scores' dtype."""
    sdpa: bool = True
    """transformers has an SDPA path for the family (Gemma 2 and BLOOM in transformers 5 do not)."""
    parallel_norms: int = 1
    """With parallel attention/MLP: 1 = both read one norm's output (Phi, Falcon-7B), 2 = each has
    its own norm of the block input (GPT-NeoX ln1/ln2, Falcon new architecture)."""
    sdpa_kv_broadcast: bool = False
    """SDPA gets fewer K/V heads than query heads without enable_gqa (Falcon multi-query): no fused
    kernel takes that, so SDPA runs its math path and keeps the attention matrix."""
    attn_bias_grad: bool = False
    """The attention mask carries a learned bias that needs grad (T5's relative position bias): SDPA
    has no fused backward for it and runs its math path."""
    ffn_dropout: bool = False
    """Dropout between the MLP activation and its down projection (T5DenseActDense)."""
    attn_softcap: bool = False
    """Gemma 2: scores / cap -> tanh -> * cap before the softmax (tanh saves its output)."""
    final_softcap: bool = False
    """Gemma 2: the same soft-capping on the final logits."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A transformer as memkit sees it. Counts are `num_*` (memkit/ARCHITECTURE.md, "Conventions")."""

    name: str
    """Catalog name, path or hub id the user gave."""
    model_type: str
    """HF `model_type` (llama, mistral, gpt2, t5, ...)."""
    architecture: str
    """HF class that `from_config` builds (LlamaForCausalLM, BertForMaskedLM, ...)."""
    kind: str
    """'decoder', 'encoder' or 'encoder-decoder'."""
    num_layers: int
    """Decoder layers (encoder layers for an encoder-only model)."""
    num_encoder_layers: int = 0
    """Encoder layers of an encoder-decoder model (T5); 0 otherwise."""
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    """Dense MLP width (per expert for MoE)."""
    vocab_size: int
    max_position_embeddings: int
    hidden_act: str
    gated_mlp: bool
    """SwiGLU/GeGLU style MLP (gate and up projections) rather than up -> act -> down."""
    norm_type: str
    """'rmsnorm' or 'layernorm'."""
    position_embedding: str
    """'rope', 'learned', 'alibi' or 'relative'."""
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    num_experts_per_tok: int = 0
    tie_word_embeddings: bool
    parallel_attn_mlp: bool = False
    """Attention and MLP read the same normed input (Falcon, GPT-J, Phi-2) instead of in sequence."""
    block: Block = Block()
    """Block structure the activation tape needs (norm placement, q/k norm, softmax dtype, ...)."""
    layer_linears: tuple[Linear, ...]
    """The linears of one (decoder) block."""
    encoder_layer_linears: tuple[Linear, ...] = ()
    """The linears of one encoder block (encoder-decoder models)."""
    num_params: int
    """Exact total, equal to sum(p.numel()) of the HF model (tied weights counted once)."""
    embedding_params: int
    """Input embeddings: token, position and token-type tables (plus their norm, if any)."""
    layer_params: int
    """Exact parameters of one decoder block. Hand-modelled families have identical blocks; a traced
    model whose blocks differ (DeepSeek's dense first blocks) gets the mean, rounded down, and
    head_params takes the remainder, so num_params stays exact."""
    encoder_layer_params: int = 0
    head_params: int
    """Everything after the last block: final norm, untied LM head or task head, pooler."""
    head_matmul_params: int = 0
    """A task head's linears after the blocks (pooler, classifier, score: weights and biases), which
    the step time multiplies at the head's rows (estimate/throughput.py); 0 for language models."""
    lora_saved_params: int = 0
    """A classifier's head modules peft trains beside LoRA's adapters, as a full copy
    (spec/hf_config.py peft_saved_params); 0 for language models."""
    hub_id: str = ""
    """Hugging Face hub id (catalog entry or cached hub model); '' for a local config."""
    config_path: str = ""
    """The config.json this spec was read from (what the runner builds the model from)."""
    linear_in_out: tuple[tuple[str, int], ...] = ()
    """Traced models: per nn.Linear name (its last dotted part), in_features + out_features summed over
    every module of that name in the model -- what peft's LoRA adds per rank for that target, exactly,
    even where blocks differ (Jamba's Mamba and attention blocks); () = the blocks' linears x layers."""
    traced: bool = False
    """Activations come from tracing the HF module itself (estimate/traced.py), not the hand tape:
    set for model types hf.py does not model by hand (spec/generic.py)."""
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    """Facts some families need (sliding_window, logit softcapping, ...). Never read by the core formulas."""

    def __hash__(self) -> int:
        """A hash of a few scalar fields, not of every field: equal specs have equal ones, which is
        all a dict or lru_cache needs (a spec that differs elsewhere only collides, and == -- every
        compared field, as the dataclass writes it -- tells them apart). The estimators' memos key
        on the spec at every estimate, and hashing its blocks' linears costs microseconds."""
        return hash((self.name, self.architecture, self.num_layers, self.hidden_size, self.vocab_size,
                     self.num_params, self.head_params))

    @property
    def approximations(self) -> tuple[str, ...]:
        """What about this model memkit prices approximately (empty for the hand-modelled families)."""
        return tuple(self.extra.get("approximations", ()))

    @property
    def auto_class(self) -> str:
        """The transformers Auto class that builds `architecture` from the config."""
        return {"decoder": "AutoModelForCausalLM", "encoder": "AutoModelForMaskedLM",
                "encoder-decoder": "AutoModelForSeq2SeqLM"}[self.kind]

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def total_layers(self) -> int:
        return self.num_layers + self.num_encoder_layers

    @property
    def block_params(self) -> int:
        """All transformer-block parameters (encoder and decoder)."""
        return self.num_layers * self.layer_params + self.num_encoder_layers * self.encoder_layer_params

    @property
    def largest_module_params(self) -> int:
        """The largest single parameter tensor group ZeRO-3 must gather at once (a block or the embedding)."""
        return max(self.layer_params, self.encoder_layer_params, self.embedding_params, self.head_params)

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Trainable LoRA parameters: r*(in+out) per targeted linear (Hu et al. 2021, Sec. 4.1); peft
        wraps every nn.Linear whose name ends in a target (peft/tuners/tuners_utils.py
        check_target_module_exists)."""
        table = dict(self.linear_in_out)
        total = rank * sum(table[t] for t in set(targets) if t in table)
        targets = tuple(t for t in targets if t not in table)  # e.g. fused 3-D experts: the blocks' counts
        for linears, count in ((self.layer_linears, self.num_layers),
                               (self.encoder_layer_linears, self.num_encoder_layers)):
            for lin in linears:
                if lin.name in targets:
                    total += count * lin.count * rank * (lin.in_features + lin.out_features)
        return total

    def linear_names(self) -> tuple[str, ...]:
        names = [lin.name for lin in self.layer_linears + self.encoder_layer_linears]
        return tuple(dict.fromkeys(names + [name for name, _ in self.linear_in_out]))
