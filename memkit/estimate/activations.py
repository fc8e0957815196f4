"""Saved activations of one transformer block, and of the embedding and loss around the blocks.

Each block is replayed op by op on a symbolic tape (tape.py) in the order HF's modeling files run
them (transformers/models/{llama,qwen3,gemma2,gpt2,phi,bert}/modeling_*.py), so GQA, gated MLPs,
the attention kernel, dropout, autocast casts, LoRA and frozen weights all fall out of the
same rules. For Llama-3.1-8B in bf16 this gives 26*bsh + 6*bs*kv*d + 8*bsi bytes per layer,
i.e. 27.8 x (bsh x 2 bytes), against the 28.0 measured by stas00/ml-engineering
(training/performance/README.md, "Forward Activations"); Korthikanti et al. 2022 (Sec. 4.1)
give 34*bsh + 5*a*s^2*b for a GPT block with dropout and eager attention.

Tensor parallelism divides the head- and intermediate-sized tensors by tp and keeps the
hidden-sized ones whole (Korthikanti et al. 2022, Table 2, "tensor parallel" row).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from operator import attrgetter

from memkit.estimate.tape import Sym, Tape
from memkit.plan.plan import TrainingPlan
from memkit.spec.model import Linear, ModelSpec

# Activations written in Python rather than as one aten kernel (transformers/activations.py):
# they save several intermediates. Value: how many extra tensors of the input's size they keep.
# Not bloom_gelu: bloom/modeling_bloom.py wraps it in a torch.autograd.Function (GeLUFunction)
# whose ctx saves only the input, like aten's gelu.
_PYTHON_GELU = {"gelu_new", "gelu_fast", "quick_gelu", "gelu_accurate"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Numerics:
    """How a forward pass stores tensors for one plan."""

    weight_itemsize: int
    """Bytes of a weight element as the module holds it (fp32 under torch AMP, 2 under DeepSpeed bf16)."""
    autocast: int | None
    """Low dtype bytes when torch autocast is on (AMP with fp32 weights), else None."""

    @property
    def stream_itemsize(self) -> int:
        """Residual stream dtype: the weights' dtype (autocast leaves adds and norms in fp32)."""
        return self.weight_itemsize


def numerics(plan: TrainingPlan) -> Numerics:
    """fp32: all fp32. DeepSpeed fp16/bf16 and bf16-pure: the module itself is cast to 16 bits
    (deepspeed/runtime/engine.py, _configure_distributed_model). FSDP mixed precision
    (torch engine, ZeRO-3) gathers each unit in bf16 and computes in it
    (torch/distributed/fsdp MixedPrecisionPolicy param_dtype). Other torch-engine fp16/bf16:
    fp32 weights under autocast (torch.autocast, as Accelerate's mixed_precision does)."""
    if plan.precision == "fp32":
        return Numerics(weight_itemsize=4, autocast=None)
    if plan.precision == "bf16-pure" or plan.engine == "deepspeed" or plan.zero_stage == 3:
        return Numerics(weight_itemsize=2, autocast=None)
    return Numerics(weight_itemsize=4, autocast=2)


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockActivations:
    saved_bytes: int
    """Bytes one block saves for backward (what checkpointing discards)."""
    input_bytes: int
    """Bytes of the block's input hidden states (what a checkpoint keeps)."""
    backward_transient_bytes: int
    """Gradient tensors alive while the block's backward runs (grad of hidden + widest intermediate)."""
    by_label: dict[str, int]
    offloaded_backward_bytes: int | None = None
    """With activation offload, the most bytes the block's backward holds at one autograd node:
    the gradients in flight and that node's unpacked saved tensors (each unpack hook returns a
    copy that dies when the node returns; the other nodes' tensors are on the host or freed).
    None where the tape is not replayed (traced families): then saved + transient bytes."""
    recompute_transient_bytes: int = 0
    layers: tuple[tuple[int, int], ...] = ()
    """State-space and hybrid stacks: (saved bytes, backward temporaries) of each of the model's
    blocks in order, which the phase walk (estimate/memory.py) uses instead of the mean; else ()."""
    """Unsaved tensors alive at the recompute's widest LoRA'd linear (its input, peft's cast of
    it, the dropout output, the base output) plus the residual the block's frame holds; 0 without
    LoRA or for traced families (not priced there)."""


def _linear_by_role(linears: tuple[Linear, ...]) -> dict[str, Linear]:
    return {lin.role: lin for lin in linears}


class _BlockReplay:
    """Replays one block on a tape. `tokens` = micro-batch x sequence length on this rank."""

    def __init__(self, spec: ModelSpec, plan: TrainingPlan, num: Numerics, tokens: int, seq_len: int,
                 linears: tuple[Linear, ...], *, tp: int, device: str):
        self.spec, self.plan, self.num = spec, plan, num
        self.tokens, self.seq_len, self.tp, self.device = tokens, seq_len, tp, device
        self.tape = Tape(autocast=num.autocast, device=device)
        self.roles = _linear_by_role(linears)
        self.lora_targets = set(plan.lora_targets) if plan.is_lora else set()
        self.train_weights = not plan.is_lora
        # peft keeps adapter weights in fp32 (autocast_adapter_dtype=True, peft/tuners/lora/
        # layer.py) and casts the input to them; DeepSpeed later casts the whole module to 16 bits.
        self.adapter_itemsize = num.weight_itemsize if plan.engine == "deepspeed" else 4
        self.base_4bit = plan.quantize_base != "none"  # bitsandbytes Linear4bit bases (memkit/plan/quantize.py)
        self.uses_scores = False  # set when the block keeps s^2 attention probabilities
        self.cross = False  # a decoder block of an encoder-decoder model (cross-attention)

    # -- pieces ---------------------------------------------------------------
    def norm(self, x: Sym) -> Sym:
        tape, spec = self.tape.region("norms"), self.spec
        h = spec.hidden_size
        if spec.norm_type == "layernorm":
            return tape.layer_norm(x)
        if spec.block.rms_norm == "gemma":
            return tape.rms_norm_gemma(x, h, weight_grad=self.train_weights)
        return tape.rms_norm_llama(x, h, weight_grad=self.train_weights,
                                   weight_itemsize=self.num.weight_itemsize)

    def proj(self, x: Sym, lin: Linear, *, split: bool) -> Sym:
        """A linear as HF calls it; `split`: its output is divided by tp (column-parallel)."""
        out = self.tokens * lin.out_features // (self.tp if split else 1)
        if lin.name in self.lora_targets:
            return self.tape.lora_linear(x, out, rank_numel=self.tokens * self.plan.lora_rank,
                                         dropout=self.plan.lora_dropout > 0,
                                         weight_itemsize=self.num.weight_itemsize,
                                         adapter_itemsize=self.adapter_itemsize, base_4bit=self.base_4bit)
        if self.base_4bit:
            return self.tape.linear_4bit(x, out)
        return self.tape.linear(x, out, weight_grad=self.train_weights,
                                weight_itemsize=self.num.weight_itemsize)

    def dropout(self, x: Sym, p: float) -> Sym:
        return self.tape.dropout(x) if p > 0 else x

    def attention(self, y: Sym) -> Sym:
        spec, tape, tp, t = self.spec, self.tape.region("attention"), self.tp, self.tokens
        heads, kv = spec.num_attention_heads // tp, max(1, spec.num_key_value_heads // tp)
        d = spec.head_dim
        q_numel, kv_numel = t * heads * d, t * kv * d
        rope = spec.position_embedding == "rope"
        # SDPA with attention dropout has no fused CPU kernel: aten falls back to the math
        # path, which keeps the probabilities like eager (aten/src/ATen/native/transformers/
        # attention.cpp, _fused_sdp_choice_cpp). CUDA's flash/efficient kernels take dropout.
        eager = self.plan.attention == "eager" or not spec.block.sdpa
        # SDPA's math fallback: CPU has no fused kernel taking attention dropout (attention.cpp,
        # _fused_sdp_choice_cpp), and no fused kernel takes K/V heads broadcast against more query
        # heads without enable_gqa (Falcon multi-query).
        # The same when the mask needs grad (T5's learned position bias: no fused backward for it).
        math = not eager and ((self.device == "cpu" and spec.attention_dropout > 0) or spec.block.sdpa_kv_broadcast
                              or spec.block.attn_bias_grad)
        if "qkv" in self.roles:
            # One fused projection split into strided views (GPT-2 c_attn, Phi-3 qkv_proj, Falcon,
            # BLOOM, GPT-NeoX query_key_value); rope writes new q and k; v stays a view.
            qkv = self.proj(y, self.roles["qkv"], split=True)
            q = Sym(q_numel, qkv.itemsize) if rope else None
            k = Sym(kv_numel, qkv.itemsize) if rope else None
            if eager:  # matmul's reshape copies every strided view it is given
                q = q or Sym(q_numel, qkv.itemsize)
                k = k or Sym(kv_numel, qkv.itemsize)
                v = Sym(kv_numel, qkv.itemsize)
            else:  # SDPA saves the views themselves: each keeps the fused storage alive
                q, k, v = q or qkv, k or qkv, qkv
        else:
            q = self.proj(y, self.roles["q"], split=True)
            k = self.proj(y, self.roles["k"], split=True)
            v = self.proj(y, self.roles["v"], split=True)
            if spec.block.qk_norm:  # Qwen3/Gemma3 q_norm, k_norm over head_dim
                self.tape.region("norms")
                q = self.tape.rms_norm_llama(q, d, weight_grad=self.train_weights,
                                             weight_itemsize=self.num.weight_itemsize)
                k = self.tape.rms_norm_llama(k, d, weight_grad=self.train_weights,
                                             weight_itemsize=self.num.weight_itemsize)
                self.tape.region("attention")
            if rope:
                # q*cos + rotate_half(q)*sin: the muls save only cos/sin (no grad); output is new.
                q, k = Sym(q.numel, q.itemsize), Sym(k.numel, k.itemsize)
        if eager:
            self.uses_scores = True
            if kv != heads:  # repeat_kv copies k and v to every query head (sdpa_attention.py)
                k, v = Sym(q_numel, k.itemsize), Sym(q_numel, v.itemsize)
            out = tape.eager_attention(q, k, v, heads=heads, tokens=t, seq_len=self.seq_len,
                                       dropout=spec.attention_dropout > 0,
                                       softmax_fp32=spec.block.softmax_fp32, softcap=spec.block.attn_softcap,
                                       out_numel=q_numel)
        elif math:
            self.uses_scores = True
            out = tape.sdpa_math(q, k, v, heads=heads, tokens=t, seq_len=self.seq_len,
                                 dropout=spec.attention_dropout > 0, out_numel=q_numel, q_numel=q_numel,
                                 kv_numel=kv_numel)
        else:
            # SDPA (flash/efficient) and flash-attn 2 save q, k, v, out, lse; GQA runs natively
            # when there is no mask (transformers/integrations/sdpa_attention.py, use_gqa_in_sdpa).
            out = tape.sdpa(q, k, v, heads=heads, tokens=t, out_numel=q_numel)
        if not eager and not math and "qkv" not in self.roles and self.device == "cpu":
            # attn_output.transpose(1, 2).contiguous() is a no-op here: CPU's flash kernel writes its
            # output in (b, s, h, d) layout and returns a transposed view of it (aten/src/ATen/native/
            # transformers/attention.cpp); o_proj saves that storage (traced and measured: the golden
            # rows). On CUDA the copy is kept: the published per-layer figure (stas00/ml-engineering,
            # 28.0 bsh x 2 bytes for Llama-3.1-8B) includes a tensor of that size.
            self.tape.region("attention")
            return self.proj(out, self.roles["o"], split=False)
        # eager, and SDPA fed strided views of a fused projection (traced: the copy is there):
        # attn_output.transpose(1, 2).contiguous() copies
        out = tape.contiguous_copy(out)
        return self.proj(out, self.roles["o"], split=False)

    def moe(self, y: Sym) -> Sym:
        """Sparse MoE block (transformers/models/mixtral/modeling_mixtral.py): the router's fp32
        softmax over experts, then per routed token a gathered copy of its hidden state, the
        expert's fused gate_up output, the activation, the product, and the down projection
        scaled by its routing weight (Fedus et al. 2021, Sec. 2.2: k experts per token)."""
        tape, spec = self.tape.region("mlp"), self.spec
        router = self.roles["router"]
        logits = self.proj(y, router, split=False)
        tape.save(Sym(logits.numel, 4, True))  # softmax(router_logits, dtype=float) output
        routed = self.tokens * spec.num_experts_per_tok
        # The experts run torch's grouped_mm on input.to(weight.dtype), which autocast does not cover
        # (transformers/integrations/moe.py, _grouped_mm): they compute in the weights' dtype.
        a = self.num.weight_itemsize
        inter = spec.intermediate_size // self.tp
        x_sel = Sym(routed * spec.hidden_size, y.itemsize, True)  # hidden_states[token_idx]
        gate_up = Sym(routed * 2 * inter, a, True)
        # grouped_mm saves its input only for the weight's grad: frozen (LoRA) experts keep none.
        experts_train = self.train_weights
        tape.save(*((self.tape.cast(x_sel, a), gate_up) if experts_train else (gate_up,)))  # act/mul read gate_up
        act_out = Sym(routed * inter, a, True)
        prod = Sym(routed * inter, a, True)
        tape.save(*((act_out, prod) if experts_train else (act_out,)))  # mul saves act_out; down saves prod
        down = Sym(routed * spec.hidden_size, a, True)
        tape.save(down)                                          # * routing weight saves both
        return Sym(self.tokens * spec.hidden_size, y.itemsize, True)

    def mlp(self, y: Sym) -> Sym:
        if self.spec.is_moe:
            return self.moe(y)
        tape = self.tape.region("mlp")
        act = self.spec.hidden_act
        if self.spec.gated_mlp:
            if "gate_up" in self.roles:  # Phi-3: one fused projection, chunked into views
                gu = self.proj(y, self.roles["gate_up"], split=True)
                tape.save(gu)  # act saves the gate half, mul the up half: both keep gu alive
                gate_act = Sym(gu.numel // 2, gu.itemsize, True)
                tape.save(gate_act)
                h = Sym(gu.numel // 2, gu.itemsize, True)
            else:
                gate = self.proj(y, self.roles["gate"], split=True)
                up = self.proj(y, self.roles["up"], split=True)
                gate_act = self._activation(gate, act)
                h = tape.mul(gate_act, up)
        else:
            up = self.proj(y, self.roles["up"], split=True)
            h = self._activation(up, act)
        if self.spec.block.ffn_dropout:  # T5DenseActDense: dropout between the activation and wo
            h = self.dropout(h, self.spec.hidden_dropout)
        return self.proj(h, self.roles["down"], split=False)

    def _activation(self, x: Sym, act: str) -> Sym:
        tape = self.tape
        if act in _PYTHON_GELU:
            # 0.5*x*(1+tanh(c*(x+0.044715*pow(x,3)))) (transformers/activations.py NewGELUActivation)
            tape.pow(x)
            # Its backward's widest node is PowBackward0: three gradients of x in flight (of
            # 0.5*x, of the add, and pow's incoming one, held in input buffers until x's node
            # runs; torch/csrc/autograd/input_buffer.cpp) plus pow_backward's unpacked x and its
            # three results x**2, 3*x**2, grad*3*x**2 (torch/csrc/autograd/FunctionsManual.cpp
            # pow_backward). Measured on GPT-2 with activation offload (benchmarks/offload_backward_nodes.py
            # --row gpt2-fp32-sdpa-sgd-micro4-offload): the backward peaks in this node, 7 x x's bytes.
            xin = tape._fp32_op(x)
            tape.python_gelu_backward_bytes = max(tape.python_gelu_backward_bytes,
                                                  3 * x.nbytes + 4 * xin.nbytes)
            inner = Sym(x.numel, tape._fp32_op(x).itemsize, x.requires_grad)
            th = tape.tanh(inner)
            one_plus = Sym(th.numel, th.itemsize, True)
            half_x = tape.scale(x)
            return tape.mul(half_x, one_plus)
        if act == "relu":
            # aten relu's backward reads its output (threshold_backward(grad, result, 0),
            # tools/autograd/derivatives.yaml), the same tensor the next linear saves: counted once.
            out = Sym(x.numel, x.itemsize, x.requires_grad)
            if x.requires_grad:
                tape.save(out)
            return out
        return tape.act_saving_input(x)

    # -- the block -------------------------------------------------------------
    def run(self, x: Sym) -> Sym:
        spec, tape = self.spec, self.tape
        if spec.block.norm_placement == "post":  # BERT: LayerNorm(dropout(attn(x)) + x), same for the MLP
            a = self.dropout(self.attention(x), spec.hidden_dropout)
            h1 = tape.region("norms").layer_norm(tape.add(a, x))
            m = self.dropout(self.mlp(h1), spec.hidden_dropout)
            return tape.region("norms").layer_norm(tape.add(m, h1))
        y = self.norm(x)
        if spec.parallel_attn_mlp:  # Falcon/Phi-2/GPT-J: attn and MLP read the same normed input
            a = self.dropout(self.attention(y), spec.hidden_dropout)
            m = self.dropout(self.mlp(self.norm(x) if spec.block.parallel_norms == 2 else y), spec.hidden_dropout)
            return tape.add(tape.add(a, m), x)
        a = self.attention(y)
        if spec.block.norm_placement == "sandwich":
            a = self.norm(a)
        a = self.dropout(a, spec.hidden_dropout)
        h1 = tape.add(x, a)
        if self.cross:  # T5 decoder: T5LayerCrossAttention, the same pre-norm residual around attention
            # whose k/v read the encoder output (one tensor all decoder blocks share, priced once: no save)
            h1 = tape.add(h1, self.dropout(self.attention(self.norm(h1)), spec.hidden_dropout))
        m = self.mlp(self.norm(h1))
        if spec.block.norm_placement == "sandwich":
            m = self.norm(m)
        m = self.dropout(m, spec.hidden_dropout)
        return tape.add(h1, m)


BLOCK_PLAN_FIELDS = ("precision", "engine", "zero_stage", "attention", "micro_batch_size", "seq_len", "tp",
                     "sequence_parallel", "lora_rank", "lora_targets", "lora_dropout", "quantize_base")
"""The TrainingPlan fields block_activations reads (numerics, _BlockReplay and its own body), the
plan's part of its memo key: the planner asks for the same block under plans that differ only in
the other fields (ZeRO offload, data parallelism, accumulation, checkpointing), thousands of times
per search. tests/unit/test_estimate_memo.py checks that changing any other field changes nothing."""


class PlanPart:
    """A plan keyed (hashed, compared) by some of its fields, carrying the plan itself: the key is
    the tuple of those fields' values, in the order `names` gives them."""

    __slots__ = ("plan", "key")

    def __init__(self, plan: TrainingPlan, names: tuple[str, ...]):
        self.plan, self.key = plan, _key_getter(names)(plan)

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other) -> bool:
        return isinstance(other, PlanPart) and self.key == other.key


_KEY_GETTERS: dict = {}
"""PlanPart's key reader for each tuple of field names, built once: operator.attrgetter reads the
fields in C (a memo key is built for every estimate the planner makes)."""


def _key_getter(names: tuple[str, ...]):
    getter = _KEY_GETTERS.get(names)
    if getter is None:
        if len(names) > 1:
            getter = attrgetter(*names)   # a tuple of the values, in names' order
        else:
            getter = lambda plan: tuple(getattr(plan, n) for n in names)  # noqa: E731 (attrgetter of one name gives the bare value)
        _KEY_GETTERS[names] = getter
    return getter


def block_activations(spec: ModelSpec, plan: TrainingPlan, *, micro_batch_size: int | None = None,
                      encoder: bool | None = None, device: str = "cuda",
                      input_requires_grad: bool = True) -> BlockActivations:
    """Saved bytes of one block for one micro-batch on one rank. An encoder-decoder model's blocks
    differ (the decoder's cross-attention): `encoder` picks one; None gives their mean over the model,
    which the phase walk multiplies by the layer count. `input_requires_grad=False`: the first
    block behind a frozen embedding (see first_block_input_frozen). Memoised on the spec and
    BLOCK_PLAN_FIELDS (a pure function of them), except for a traced spec: its trace reads the
    whole plan and spec.extra, which ModelSpec's hash and == leave out."""
    b = micro_batch_size or plan.micro_batch_size
    if spec.traced:
        return _block_activations(spec, plan, b, encoder, device, input_requires_grad)
    return _memo_block_activations(spec, PlanPart(plan, BLOCK_PLAN_FIELDS), b, encoder, device,
                                   input_requires_grad)


@lru_cache(maxsize=4096)
def _memo_block_activations(spec: ModelSpec, part: PlanPart, b: int, encoder: bool | None, device: str,
                            input_requires_grad: bool) -> BlockActivations:
    return _block_activations(spec, part.plan, b, encoder, device, input_requires_grad)


def _block_activations(spec: ModelSpec, plan: TrainingPlan, b: int, encoder: bool | None, device: str,
                       input_requires_grad: bool) -> BlockActivations:
    """block_activations, computed."""
    num = numerics(plan)
    if encoder is None and spec.num_encoder_layers and not spec.traced:
        enc, dec = (block_activations(spec, plan, micro_batch_size=b, encoder=e, device=device) for e in (True, False))
        n_enc, n_dec, total = spec.num_encoder_layers, spec.num_layers, spec.total_layers

        def mean(a: int, c: int) -> int:
            return (a * n_enc + c * n_dec) // total

        return BlockActivations(saved_bytes=mean(enc.saved_bytes, dec.saved_bytes), input_bytes=dec.input_bytes,
                                backward_transient_bytes=max(enc.backward_transient_bytes,
                                                             dec.backward_transient_bytes),
                                by_label={k: mean(enc.by_label.get(k, 0), dec.by_label.get(k, 0))
                                          for k in {**enc.by_label, **dec.by_label}},
                                offloaded_backward_bytes=None if None in (enc.offloaded_backward_bytes,
                                                                          dec.offloaded_backward_bytes)
                                else max(enc.offloaded_backward_bytes, dec.offloaded_backward_bytes))
    encoder = bool(encoder)
    tokens = b * plan.seq_len
    linears = spec.encoder_layer_linears if encoder else spec.layer_linears
    if plan.sequence_parallel and plan.tp > 1:
        # Tensor + sequence parallel: every saved tensor of the block is 1/t of the unsplit one
        # (Korthikanti et al. 2022, Table 2: sbh(34/t + 5as/(ht)) against sbh(34 + 5as/h)).
        whole = block_activations(spec, replace(plan, tp=1, sequence_parallel=False),
                                  micro_batch_size=b, encoder=encoder, device=device)
        t = plan.tp
        return BlockActivations(saved_bytes=whole.saved_bytes // t, input_bytes=whole.input_bytes // t,
                                backward_transient_bytes=whole.backward_transient_bytes // t,
                                by_label={k: v // t for k, v in whole.by_label.items()},
                                offloaded_backward_bytes=None if whole.offloaded_backward_bytes is None
                                else whole.offloaded_backward_bytes // t)
    x = Sym(tokens * spec.hidden_size, num.stream_itemsize, input_requires_grad)
    trace = _trace(spec, plan, b, device) if spec.traced else None
    if spec.traced and trace is None:
        return block_activations(_llama_equivalent(spec), plan, micro_batch_size=b, device=device)
    if trace is not None:  # any other architecture: what autograd saves in the HF module itself
        # A (non-sequence-parallel) TP rank keeps the hidden-sized tensors whole and splits the
        # rest; the trace does not tell them apart, so tp divides nothing (an upper bound).
        saved, labels, uses_scores = trace.block_saved_bytes, {"traced": trace.block_saved_bytes}, \
            trace.attention == "eager"
        lora_live, offloaded = 0, None
    else:
        replay = _BlockReplay(spec, plan, num, tokens, plan.seq_len, linears, tp=plan.tp, device=device)
        replay.cross = spec.kind == "encoder-decoder" and not encoder
        replay.run(x)
        saved, labels, uses_scores = replay.tape.saved_bytes, dict(replay.tape.labels), replay.uses_scores
        lora_live = replay.tape.lora_forward_live
        node_saved, gelu_bwd = replay.tape.node_saved_max, replay.tape.python_gelu_backward_bytes
    # A (non-sequence-parallel) TP rank keeps full hidden-sized tensors (Korthikanti Table 2).
    act = num.autocast or num.weight_itemsize
    widest = max(spec.intermediate_size // plan.tp * (2 if spec.gated_mlp else 1),
                 spec.hidden_size)
    # During a block's backward: grad of the hidden stream in and out, plus the gradients of the
    # widest intermediate (the gated MLP's gate/up pair) -- aten's mul/silu backward outputs.
    transient = 2 * tokens * spec.hidden_size * num.stream_itemsize + tokens * widest * act
    if uses_scores:  # grads of the probabilities and of the scores (softmax backward)
        transient = max(transient, (spec.num_attention_heads // plan.tp) * tokens * plan.seq_len * act)
    layers = ()
    if trace is not None and trace.layers:
        # State-space and hybrid stacks (transformers/models/jamba/modeling_jamba.py: Mamba and
        # attention blocks interleave by attn_layer_period / attn_layer_offset): each block's saved
        # bytes, and its backward temporaries plus its selective scan's backward (estimate/ssm.py).
        layers = tuple((saved_j, transient + scan_j) for saved_j, scan_j in trace.layers)
    if trace is None:  # with offload: the widest node's unpacked tensors + the gradients in flight,
        # or a Python GELU's pow node with the residual stream's gradient held beside it
        offloaded = max(transient + node_saved, tokens * spec.hidden_size * num.stream_itemsize + gelu_bwd)
    return BlockActivations(saved_bytes=saved, input_bytes=x.nbytes,
                            backward_transient_bytes=transient, by_label=labels, offloaded_backward_bytes=offloaded,
                            recompute_transient_bytes=lora_live + x.nbytes if lora_live else 0, layers=layers)


def _trace(spec: ModelSpec, plan: TrainingPlan, micro_batch_size: int, device: str):
    """The traced activations of `spec`, or None where its module cannot be traced (activation_source)."""
    from memkit.estimate.traced import RefusedVariant, trace_plan  # lazy: torch only for traced models

    try:
        return trace_plan(json.loads(spec.extra["traced_config"]), auto_class=spec.extra["auto_class"], plan=plan,
                          micro_batch_size=micro_batch_size, device=device)
    except RefusedVariant:  # the libraries refuse the plan itself: say why, price nothing
        raise
    except Exception:  # noqa: BLE001 -- any failure inside a foreign module: fall back, and say so
        return None


def activation_source(spec: ModelSpec, plan: TrainingPlan, *, device: str = "cuda") -> str:
    """Where the activations of `spec` under `plan` come from, in words (the CLI prints it)."""
    if not spec.traced:
        return "hand-modelled tape"
    trace = _trace(spec, plan, plan.micro_batch_size, device)
    if trace is None:
        return (f"the {spec.model_type} module could not be traced: activations priced as a Llama-style "
                "block of the same sizes")
    notes = "; ".join(trace.notes)
    return f"traced from the transformers {spec.model_type} module" + (f" ({notes})" if notes else "")


def _llama_equivalent(spec: ModelSpec) -> ModelSpec:
    """A hand-modelled Llama block with `spec`'s sizes: the fallback when tracing fails."""
    from memkit.spec.hf import spec_from_config

    return spec_from_config({"model_type": "llama", "hidden_size": spec.hidden_size,
                             "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_attention_heads,
                             "num_key_value_heads": spec.num_key_value_heads, "head_dim": spec.head_dim,
                             "intermediate_size": spec.intermediate_size, "vocab_size": spec.vocab_size,
                             "max_position_embeddings": spec.max_position_embeddings}, name=spec.name)


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadActivations:
    saved_bytes: int
    """Saved for backward from the final norm to the loss (fp32 log-probs, lm_head input)."""
    forward_peak_bytes: int
    """Extra bytes at the loss computation's forward peak (the logits and their fp32 copy)."""
    backward_peak_bytes: int
    """Extra bytes while the loss backward runs (grads of the fp32 log-probs)."""
    embedding_bytes: int
    """Saved by the embedding (int64 ids) and the batch tensors (ids, labels, shifted labels)."""


HEAD_PLAN_FIELDS = BLOCK_PLAN_FIELDS + ("loss_path", "checkpointing", "task", "num_labels", "target_len")
"""The TrainingPlan fields head_activations reads (the final norm's _BlockReplay, loss_path_bytes,
_loss_peaks, checkpointed_bias_bytes), the plan's part of its memo key (as BLOCK_PLAN_FIELDS)."""


def head_activations(spec: ModelSpec, plan: TrainingPlan, *, micro_batch_size: int | None = None,
                     device: str = "cuda") -> HeadActivations:
    """Final norm, LM head and cross-entropy, as HF's ForCausalLMLoss runs them
    (transformers/loss/loss_utils.py: logits.float() then cross_entropy = log_softmax + nll_loss).
    Memoised on the spec and HEAD_PLAN_FIELDS but for a traced spec (as block_activations)."""
    b = micro_batch_size or plan.micro_batch_size
    if spec.traced:
        return _head_activations(spec, plan, b, device)
    return _memo_head_activations(spec, PlanPart(plan, HEAD_PLAN_FIELDS), b, device)


@lru_cache(maxsize=4096)
def _memo_head_activations(spec: ModelSpec, part: PlanPart, b: int, device: str) -> HeadActivations:
    return _head_activations(spec, part.plan, b, device)


def _head_activations(spec: ModelSpec, plan: TrainingPlan, b: int, device: str) -> HeadActivations:
    """head_activations, computed."""
    num = numerics(plan)
    if plan.sequence_parallel and plan.tp > 1:
        # Loss parallel: the final norm runs on a sequence shard and the logits stay sharded by
        # vocabulary (torch.distributed.tensor.parallel.loss_parallel).
        whole = head_activations(spec, replace(plan, tp=1, sequence_parallel=False),
                                 micro_batch_size=b, device=device)
        t = plan.tp
        forward_peak, backward_peak = _loss_parallel_peaks(b * plan.seq_len * spec.vocab_size // t,
                                                           num.autocast or num.weight_itemsize)
        return HeadActivations(saved_bytes=whole.saved_bytes // t, forward_peak_bytes=forward_peak,
                               backward_peak_bytes=backward_peak,
                               embedding_bytes=whole.embedding_bytes // t)
    tokens = b * plan.seq_len
    if spec.traced:
        return _traced_head(spec, plan, b, tokens, device)
    tape = Tape(autocast=num.autocast, device=device)
    x = Sym(tokens * spec.hidden_size, num.stream_itemsize, True)
    post_norm = spec.block.norm_placement == "post"
    if spec.kind != "encoder" or not post_norm:
        replay = _BlockReplay(spec, plan, num, tokens, plan.seq_len, spec.layer_linears, tp=1,
                              device=device)
        replay.tape = tape
        x = replay.norm(x)
    if post_norm:  # BERT MLM head: dense -> gelu -> LayerNorm -> decoder
        tape.region("head")
        hdn = tape.linear(x, tokens * spec.hidden_size, weight_grad=not plan.is_lora,
                          weight_itemsize=num.weight_itemsize)
        x = tape.layer_norm(tape.act_saving_input(hdn))
    tape.region("head")
    logits_itemsize = num.autocast or num.weight_itemsize
    tape.linear(x, 0, weight_grad=not plan.is_lora, weight_itemsize=num.weight_itemsize)
    saved = tape.saved_bytes + tokens * spec.vocab_size * sum(loss_path_bytes(plan).saved)  # + the log-probs
    if spec.block.final_softcap:  # Gemma 2: logits = tanh(logits / cap) * cap; tanh saves its output
        saved += tokens * spec.vocab_size * logits_itemsize
    forward_peak, backward_peak = _loss_peaks(tokens * spec.vocab_size, plan)
    embedding = tokens * 8 * 4  # embedding indices + input_ids, labels, shifted labels (int64)
    embedding += checkpointed_bias_bytes(spec, plan, b)
    return HeadActivations(saved_bytes=saved, forward_peak_bytes=forward_peak,
                           backward_peak_bytes=backward_peak, embedding_bytes=embedding)


def _traced_head(spec: ModelSpec, plan: TrainingPlan, b: int, tokens: int, device: str) -> HeadActivations:
    """The traced model's head and embedding regions (estimate/traced.py): the head's saved tensors
    include the fp32 log-probs; the loss peaks are those of HF's loss (_loss_peaks)."""
    trace = _trace(spec, plan, b, device)
    if trace is None:
        return head_activations(_llama_equivalent(spec), plan, micro_batch_size=b, device=device)
    num = numerics(plan)
    rows, width = head_logits(spec, plan, b)
    forward_peak, backward_peak = _loss_peaks(rows * width, plan)
    # The trace ran HF's loss (fp32 log-probs saved); another loss path saves its own instead.
    path_saved = rows * width * (sum(loss_path_bytes(plan).saved) - 4)
    # The batch's input_ids are saved by the embedding (traced); labels live beside them (int64).
    return HeadActivations(saved_bytes=trace.head_saved_bytes + path_saved, forward_peak_bytes=forward_peak,
                           backward_peak_bytes=backward_peak,
                           embedding_bytes=trace.embedding_saved_bytes + rows * 8
                           + checkpointed_bias_bytes(spec, plan, b))


def checkpointed_bias_bytes(spec: ModelSpec, plan: TrainingPlan, b: int) -> int:
    """T5Stack (t5/modeling_t5.py): block 0 returns the position bias (b, heads, query, key) and every
    block takes it as an argument, which a checkpoint keeps until its backward (torch.utils.checkpoint):
    one per encoder (source x source), two per decoder (self: target x target; cross: target x source).
    The trace runs no checkpoint, so both paths add it here."""
    if not (spec.block.attn_bias_grad and plan.checkpointing == "full"):
        return 0
    s = plan.seq_len
    t = plan.target_len or s
    if spec.kind == "encoder-decoder":
        squares = (s * s if spec.num_encoder_layers else 0) + t * t + t * s
    else:
        squares = s * s
    return b * spec.num_attention_heads * squares * numerics(plan).weight_itemsize


def head_logits(spec: ModelSpec, plan: TrainingPlan, micro_batch_size: int | None = None) -> tuple[int, int]:
    """(rows, width) of one micro-batch's logits, rows also its labels: a language model's are one
    row per token (an encoder-decoder's per decoder token: plan.target_len, else seq_len) of
    vocab_size; a classifier's (plan.task) num_labels per sequence (seq-cls: the pooled first/last
    token, e.g. bert/modeling_bert.py BertForSequenceClassification) or per token (token-cls)."""
    b = micro_batch_size or plan.micro_batch_size
    if plan.task == "seq-cls":
        return b, plan.num_labels
    if plan.task == "token-cls":
        return b * plan.seq_len, plan.num_labels
    target = plan.target_len if plan.target_len and spec.kind == "encoder-decoder" else plan.seq_len
    return b * target, spec.vocab_size


def head_weight_elements(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Elements of the head's matmul weights autocast casts (and caches) for the loss: the LM head's
    vocab x hidden, or a classification head's linears (spec.head_params: pooler/dense and classifier,
    weights and biases, e.g. deberta_v2 ContextPooler + classifier)."""
    return spec.vocab_size * spec.hidden_size if plan.task == "causal-lm" else spec.head_params


def _loss_parallel_peaks(vocab_tokens: int, logits_itemsize: int) -> tuple[int, int]:
    """The same peaks under loss_parallel, which runs its own log-softmax and nll backward on the
    vocabulary shard (torch/distributed/tensor/parallel/loss.py). Forward `_log_softmax`: the
    logits, their fp32 copy, `shifted = x - x_max` and `exp(shifted)` (then the log-probs) coexist.
    Backward `_nll_loss_and_log_softmax_backward`: `grad_input = zeros_like(x)`, `exp(x)` and their
    sum, then the product with grad_output, beside the saved log-probs: three fp32 tensors."""
    fp32_copy = 0 if logits_itemsize == 4 else vocab_tokens * 4
    return vocab_tokens * logits_itemsize + fp32_copy + vocab_tokens * 4, 3 * vocab_tokens * 4


@dataclass(frozen=True, slots=True, kw_only=True)
class LossPathBytes:
    """The loss's tensors on the materialised logits, per plan.loss_path, in bytes per logit element
    (rows x vocabulary), in the order they are allocated."""
    saved: tuple[int, ...]
    """Alive from the forward until the loss backward ends: the log-probs log_softmax saves, and
    the fp32 logits an 'upcast' loop holds."""
    forward_work: tuple[int, ...]
    """Allocated in the loss's forward beside `saved`, freed before backward: the logits the head
    returns (nothing saves them; the loop drops the model output), their fp32 copy."""
    backward_work: tuple[int, ...]
    """Allocated anew by the loss backward beside `saved`: grad of the log-probs, grad of the logits."""


def loss_path_bytes(plan: TrainingPlan) -> LossPathBytes:
    """Per logit element, the tensors of the plan's loss path (memkit/plan/techniques.py LOSS_PATHS).
    'hf': transformers ForCausalLMLoss (loss/loss_utils.py): `logits = logits.float()`, then
    cross_entropy = log_softmax (saves its fp32 output) + nll_loss; backward: aten
    _log_softmax_backward_data allocates the grad of the logits beside the grad of the log-probs.
    'ce-16bit': F.cross_entropy on the 16-bit logits: log_softmax saves its output in their dtype
    and the backward's two gradients are in it too; under autocast log_softmax runs in fp32
    (aten/src/ATen/autocast_mode.cpp: log_softmax is fp32_set_opt_dtype), as 'hf'. 'upcast': the
    16-bit logits' fp32 copy is held by the loop (torchtune TransformerDecoder.forward
    `self.output(h).float()`, the recipe's `logits` local alive through `loss.backward()`), so it
    is saved-sized until backward ends, beside the fp32 log-probs; the 16-bit logits die at the cast."""
    num = numerics(plan)
    c = num.autocast or num.weight_itemsize
    if plan.loss_path == "ce-16bit" and not num.autocast:
        return LossPathBytes(saved=(c,), forward_work=(c,), backward_work=(c, c))
    if plan.loss_path == "upcast":
        return LossPathBytes(saved=(4, 4), forward_work=(c,) if c != 4 else (), backward_work=(4, 4))
    return LossPathBytes(saved=(4,), forward_work=(c, 4) if c != 4 else (c,), backward_work=(4, 4))


def _loss_peaks(vocab_tokens: int, plan: TrainingPlan) -> tuple[int, int]:
    """Forward and backward peaks of the plan's loss path beyond what it saves (loss_path_bytes).
    Forward: the logits and their fp32 copy coexist inside cross_entropy; nothing saves the
    logits, and a loop that drops the model output before backward (HF Trainer, memkit's runner)
    frees them. Backward: the grads of the log-probs and of the logits coexist with the saved."""
    path = loss_path_bytes(plan)
    return vocab_tokens * sum(path.forward_work), vocab_tokens * sum(path.backward_work)
