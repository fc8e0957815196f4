"""A symbolic autograd tape: which tensors a forward pass saves for backward, and their bytes.

Each op below mirrors what the matching PyTorch autograd node saves
(torch/csrc/autograd/FunctionsManual.cpp and tools/autograd/derivatives.yaml in pytorch/pytorch):
`mul` saves `other` only if `self` needs grad and `self` only if `other` does; `linear` saves its
input only when the weight needs grad and the weight only when the input does; `silu`/`gelu`
save their input; `tanh`/`softmax`/`log_softmax` save their output; `add`, casts, views, `cat`
save nothing. Under autocast the dtype rules follow torch/csrc/autograd/autocast_mode.cpp:
`linear`/`matmul`/`sdpa` run in the low dtype (casting each non-leaf input afresh per call);
on CUDA `pow`/`layer_norm`/`softmax` run in fp32 (CPU autocast's fp32 list has none of them);
everything else promotes.

Counting saved tensors by identity (a tensor saved by two ops counts once) is what makes the
estimate exact for the blocks HF writes; tests compare it with live-tensor measurements.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count

_ids = count()


@dataclass(slots=True)
class Sym:
    """A symbolic tensor: element count, element bytes, whether autograd tracks it."""

    numel: int
    itemsize: int
    requires_grad: bool = True
    ident: int = field(default_factory=lambda: next(_ids))

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(slots=True)
class Tape:
    """Records saved tensors of one forward region. `autocast`: low dtype bytes (2) or None."""

    autocast: int | None = None
    device: str = "cuda"
    saved: dict[int, int] = field(default_factory=dict)
    labels: dict[str, int] = field(default_factory=dict)
    label: str = "other"
    lora_forward_live: int = 0
    """Most bytes a LoRA'd linear holds unsaved while its adapter runs (see lora_linear)."""
    node_saved_max: int = 0
    """Most bytes one autograd node saves (one save() call is one node): what its backward
    unpacks at once under activation offload (each unpack hook returns a fresh copy)."""
    python_gelu_backward_bytes: int = 0
    """Most bytes a Python-written tanh GELU's backward holds at its pow node (see
    activations.py _BlockReplay._activation); 0 without one."""

    # -- bookkeeping -------------------------------------------------------
    def save(self, *tensors: Sym) -> None:
        self.node_saved_max = max(self.node_saved_max, sum(t.nbytes for t in tensors))
        for t in tensors:
            if t.ident not in self.saved:
                self.saved[t.ident] = t.nbytes
                self.labels[self.label] = self.labels.get(self.label, 0) + t.nbytes

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved.values())

    def region(self, label: str) -> "Tape":
        self.label = label
        return self

    # -- dtype helpers -------------------------------------------------------
    def cast(self, x: Sym, itemsize: int) -> Sym:
        """`x.to(dtype)`: a new tensor when the dtype changes; saves nothing."""
        if x.itemsize == itemsize:
            return x
        return Sym(x.numel, itemsize, x.requires_grad)

    def _fp32_op(self, x: Sym) -> Sym:
        """Input of an op on CUDA autocast's fp32 list (pow, layer_norm, softmax)."""
        return self.cast(x, 4) if (self.autocast and self.device == "cuda") else x

    def _autocast_in(self, x: Sym) -> Sym:
        """Autocast casts a non-leaf input to the low dtype afresh on every call."""
        return self.cast(x, self.autocast) if self.autocast else x

    # -- ops -------------------------------------------------------------------
    def linear(self, x: Sym, out_numel: int, *, weight_grad: bool, weight_itemsize: int) -> Sym:
        xin = self._autocast_in(x)
        if weight_grad:
            self.save(xin)  # grad_weight = grad_out^T @ input
        out_size = self.autocast or weight_itemsize
        return Sym(out_numel, out_size, weight_grad or x.requires_grad)

    def linear_4bit(self, x: Sym, out_numel: int) -> Sym:
        """bitsandbytes Linear4bit (nn/modules.py forward; autograd/_functions.py MatMul4Bit): the
        input cast to the compute dtype, the output cast back to the input's dtype; autograd saves
        only the packed weight, and autocast does not cast it (no aten linear on its inputs)."""
        return Sym(out_numel, x.itemsize, x.requires_grad)

    def lora_linear(self, x: Sym, out_numel: int, *, rank_numel: int, dropout: bool,
                    weight_itemsize: int, adapter_itemsize: int, base_4bit: bool = False) -> Sym:
        """peft LoraLayer.forward (peft/tuners/lora/layer.py): base(x) + lora_B(lora_A(dropout(x)))
        * scaling, with x cast to the adapter's dtype first, the sum cast back to the base's.
        A 4-bit base (peft/tuners/lora/bnb.py Linear4bit.forward) clones its output: a temporary."""
        base = (self.linear_4bit(x, out_numel) if base_4bit else
                self.linear(x, out_numel, weight_grad=False, weight_itemsize=weight_itemsize))
        # peft's Linear.forward casts x to the adapter's dtype (_cast_input_dtype) under autocast
        # too, so a 16-bit input is upcast before the dropout (whose CPU noise then is fp32);
        # its Linear4bit (peft/tuners/lora/bnb.py) casts only when autocast is off.
        xa = x if (self.autocast and base_4bit) else self.cast(x, adapter_itemsize)
        xd = self.dropout(xa) if dropout else xa
        a = self.linear(xd, rank_numel, weight_grad=True, weight_itemsize=adapter_itemsize)
        # Alive unsaved at lora_A's matmul (peft Linear.forward's locals): the base's output, the
        # input and its cast, the dropout's output -- each unless autograd saved it (by identity).
        live = {t.ident: t.nbytes for t in (base, x, xa, xd) if t.ident not in self.saved}
        self.lora_forward_live = max(self.lora_forward_live, sum(live.values()))
        b = self.linear(a, out_numel, weight_grad=True, weight_itemsize=adapter_itemsize)
        return self.cast(self.add(base, b), base.itemsize)

    def add(self, a: Sym, b: Sym) -> Sym:
        return Sym(max(a.numel, b.numel), max(a.itemsize, b.itemsize), a.requires_grad or b.requires_grad)

    def mul(self, a: Sym, b: Sym) -> Sym:
        self.save(*([b] if a.requires_grad else []), *([a] if b.requires_grad else []))  # one MulBackward0
        return Sym(max(a.numel, b.numel), max(a.itemsize, b.itemsize), a.requires_grad or b.requires_grad)

    def scale(self, a: Sym) -> Sym:
        """Multiply by a Python scalar: saves nothing."""
        return Sym(a.numel, a.itemsize, a.requires_grad)

    def act_saving_input(self, x: Sym) -> Sym:
        """silu, relu, gelu (erf or tanh form, native kernels): backward reads the input."""
        if x.requires_grad:
            self.save(x)
        return Sym(x.numel, x.itemsize, x.requires_grad)

    def tanh(self, x: Sym) -> Sym:
        out = Sym(x.numel, x.itemsize, x.requires_grad)
        if x.requires_grad:
            self.save(out)
        return out

    def pow(self, x: Sym) -> Sym:
        xin = self._fp32_op(x)
        if x.requires_grad:
            self.save(xin)
        return Sym(x.numel, xin.itemsize, x.requires_grad)

    def dropout(self, x: Sym) -> Sym:
        """Training-mode dropout. CUDA runs aten native_dropout, which saves a bool mask; on CPU
        aten/src/ATen/native/Dropout.cpp (_dropout_impl) multiplies by a noise tensor of the
        input's dtype, and that mul saves the noise."""
        mask = Sym(x.numel, 1 if self.device == "cuda" else x.itemsize, False)
        if x.requires_grad:
            self.save(mask)
        return Sym(x.numel, x.itemsize, x.requires_grad)

    def rms_norm_llama(self, x: Sym, hidden: int, *, weight_grad: bool, weight_itemsize: int) -> Sym:
        """LlamaRMSNorm (transformers/models/llama/modeling_llama.py): fp32 math, cast back, weight * x."""
        x32 = self.cast(x, 4)
        if x.requires_grad:
            self.save(x32)  # pow(2) and x * rsqrt both read the fp32 input
        normed32 = Sym(x.numel, 4, x.requires_grad)
        normed = self.cast(normed32, x.itemsize)
        weight = Sym(hidden, weight_itemsize, weight_grad)
        return self.mul(weight, normed) if (weight_grad or normed.requires_grad) else normed

    def rms_norm_gemma(self, x: Sym, hidden: int, *, weight_grad: bool) -> Sym:
        """GemmaRMSNorm (transformers/models/gemma/modeling_gemma.py): (x_fp32 normed * (1+w)).type_as(x)."""
        x32 = self.cast(x, 4)
        if x.requires_grad:
            self.save(x32)
        normed32 = Sym(x.numel, 4, x.requires_grad)
        w32 = Sym(hidden, 4, weight_grad)
        out32 = self.mul(normed32, w32)
        return self.cast(out32, x.itemsize)

    def layer_norm(self, x: Sym) -> Sym:
        """aten native_layer_norm saves input (and per-row mean/rstd); autocast runs it in fp32."""
        xin = self._fp32_op(x)
        if x.requires_grad:
            self.save(xin)
        return Sym(x.numel, xin.itemsize, True)

    def contiguous_copy(self, x: Sym) -> Sym:
        return Sym(x.numel, x.itemsize, x.requires_grad)

    def sdpa(self, q: Sym, k: Sym, v: Sym, *, heads: int, tokens: int, out_numel: int) -> Sym:
        """Flash / memory-efficient SDPA: saves q, k, v (a view keeps its whole storage), the
        output and the fp32 logsumexp (b*heads*s) (ScaledDotProductFlashAttention*Backward)."""
        if self.autocast:
            q, k, v = (self.cast(t, self.autocast) for t in (q, k, v))
        out = Sym(out_numel, q.itemsize, True)
        self.save(q, k, v, out, Sym(heads * tokens, 4, False))
        return out

    def sdpa_math(self, q: Sym, k: Sym, v: Sym, *, heads: int, tokens: int, seq_len: int, dropout: bool,
                  out_numel: int, q_numel: int, kv_numel: int) -> Sym:
        """SDPA's math fallback (aten/src/ATen/native/transformers/attention.cpp,
        _scaled_dot_product_attention_math): q*sqrt(scale) and k^T*sqrt(scale) are new tensors that
        matmul's reshape copies at full head count (a broadcast K/V head is expanded), softmax saves its
        output, then dropout and matmul with v (expanded likewise). On CPU, 16-bit inputs are upcast to
        fp32 first and the output cast back."""
        if self.autocast:
            q = self.cast(q, self.autocast)
        size = 4 if (self.device == "cpu" and q.itemsize == 2) else q.itemsize
        # A broadcast K/V head folds into matmul's batch without a copy when the micro batch is 1
        # (the stride-0 head dim merges with a size-1 batch dim); otherwise reshape copies it per head.
        # (q, k, v may be views of a fused projection: sizes are per head, q_numel / kv_numel.)
        kv_numel = q_numel if tokens > seq_len else kv_numel
        self.save(Sym(q_numel, size, True), Sym(kv_numel, size, True))  # q scaled, k^T scaled
        probs = Sym(heads * tokens * seq_len, size, True)
        self.save(probs)                                            # softmax output
        if dropout:
            probs = self.dropout(probs)
        self.save(probs, Sym(kv_numel, size, True))                 # matmul(probs, v)
        return Sym(out_numel, q.itemsize, True)

    def eager_attention(self, q: Sym, k: Sym, v: Sym, *, heads: int, tokens: int, seq_len: int,
                        dropout: bool, softmax_fp32: bool, out_numel: int, softcap: bool = False) -> Sym:
        """transformers eager_attention_forward: softmax(q k^T * scale + mask).to(v) @ v; Llama-style
        models ask softmax for fp32, GPT-2/BERT-style ones run it in the scores' dtype (autocast: fp32).
        torch.matmul flattens batch dims with reshape, so q/k/v given as strided views of a fused
        projection are saved as fresh contiguous copies (callers pass those)."""
        if self.autocast:
            q, k, v = (self.cast(t, self.autocast) for t in (q, k, v))
        self.save(q, k)  # matmul(q, k^T)
        numel = heads * tokens * seq_len
        if softcap:  # Gemma 2 (gemma2/modeling_gemma2.py): tanh(scores / cap) * cap; tanh saves its output
            self.tanh(Sym(numel, q.itemsize, True))
        probs_raw = Sym(numel, 4 if softmax_fp32 else self._fp32_op(q).itemsize, True)
        self.save(probs_raw)  # softmax saves its output
        probs = self.cast(probs_raw, q.itemsize)
        if dropout:
            probs = self.dropout(probs)
        self.save(probs, v)  # matmul(probs, v)
        return Sym(out_numel, q.itemsize, True)
