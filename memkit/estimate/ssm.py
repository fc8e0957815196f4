"""State-space (Mamba) mixers in the trace: what the selective scan saves, without running its loop.

Which path is priced: transformers' torch path, the one that runs where the CUDA kernels
`mamba_ssm` / `causal_conv1d` are not installed (always on CPU, and the golden rows measure it):
`mamba_selective_scan` in transformers/models/mamba/modeling_mamba.py (the same function in
jamba/modeling_jamba.py and falcon_mamba/modeling_falcon_mamba.py), called by MambaMixer.forward
/ JambaMambaMixer.forward. The fused CUDA kernel (mamba_ssm's MambaInnerFn, selective_scan_cuda)
saves another, smaller set -- the conv and x_proj inputs, delta and the chunked states --, which
memkit does not price: on a GPU with mamba_ssm installed the estimate is an upper bound.

The torch path discretises the whole sequence at once (vectorised ops the trace runs as they are)
and then runs a Python loop of `seq_len` steps:

    ssm_state = discrete_A[:, :, i] * ssm_state + deltaB_u[:, :, i]
    scan_output = torch.matmul(ssm_state.to(input_dtype), C[:, i, :].unsqueeze(-1))

Traced step by step that loop costs minutes per block at real sequence lengths, so the trace
swaps in `priced_selective_scan`: the function's own code, with the loop replaced by one
autograd.Function (_SequentialScan) that saves tensors of exactly the bytes the loop's nodes save,
by the same rules (tools/autograd/derivatives.yaml: mul saves `other` if `self` needs grad and
`self` if `other` does; bmm saves mat2 if self needs grad and self if mat2 does):
- step i's mul saves the previous state if discrete_A needs grad (state 0: zeros of the input
  dtype; states 1..s-1: fp32, as discrete_A is fp32) and the slice of discrete_A (its storage)
  if the state needs grad (every state after the first);
- step i's matmul saves the cast state if C needs grad (fp32 input: the state itself, which adds
  the last state; otherwise a copy in the input dtype per step) and C's storage if the state does.
tests/unit/test_traced_arch.py checks the swap against the real loop on a short sequence.
"""
from __future__ import annotations

import contextlib

# Modules whose `mamba_selective_scan` is the torch path above (same source in transformers 5.24).
SCAN_MODULES = ("transformers.models.mamba.modeling_mamba", "transformers.models.jamba.modeling_jamba",
                "transformers.models.falcon_mamba.modeling_falcon_mamba")


# The scan's backward (derivatives.yaml: select -> select_backward, a zero tensor of the input's whole
# size per step): while the loop is differentiated, the gradient buffers of discrete_A and deltaB_u
# (each b x d_inner x s x N fp32, autograd's InputBuffer accumulating one step's full-size grad at a
# time), that step's full-size select_backward output, and after the loop exp's and the
# discretisation's full-size grads (ExpBackward, MulBackward0) are alive at once.
# Measured: a MambaMixer's backward peaks 4.0-4.1 of them above its saved tensors and output grad
# (LiveTensorTracker, b 1-2 x s 64-128 x d_inner 128-256 x N 8-16; tests/unit/test_traced_arch.py).
SCAN_BACKWARD_FULL_TENSORS = 4


def _scan_function(sizes: list, where):
    import torch

    class _SequentialScan(torch.autograd.Function):
        @staticmethod
        def forward(ctx, discrete_A, deltaB_u, C, input_dtype_probe):
            b, d, s, n = discrete_A.shape
            sizes.append((where(), SCAN_BACKWARD_FULL_TENSORS * discrete_A.numel() * 4))
            input_dtype = input_dtype_probe.dtype
            grad_a, grad_c = discrete_A.requires_grad, C.requires_grad
            grad_state = grad_a or deltaB_u.requires_grad  # every state after the zeros
            fp32 = input_dtype == torch.float32
            zeros = discrete_A.new_zeros((b, d, n), dtype=input_dtype)
            # One step's matmul, for its output dtype (autocast's, else the input's).
            step = torch.matmul(zeros.to(input_dtype), C[:, 0, :].unsqueeze(-1))
            mid = discrete_A.new_empty((max(0, s - 1), b, d, n), dtype=torch.float32)  # states 1..s-1
            last = discrete_A.new_empty((b, d, n), dtype=torch.float32)                 # state s
            save = []
            if grad_a:
                save += [zeros, mid]
            if grad_state and s > 1:
                save.append(discrete_A)
            if grad_c:
                save += [mid, last] if fp32 else [discrete_A.new_empty((s, b, d, n), dtype=input_dtype)]
            if grad_state:
                save.append(C)
            seen, unique = set(), []
            for t in save:
                if id(t) not in seen:
                    seen.add(id(t))
                    unique.append(t)
            ctx.save_for_backward(*unique)
            return discrete_A.new_empty((b, d, s), dtype=step.dtype)

        @staticmethod
        def backward(ctx, grad):  # pragma: no cover -- the trace runs no backward
            raise NotImplementedError("memkit's priced selective scan has no backward")

    return _SequentialScan


def priced_selective_scan(original, sizes: list, where=lambda: ""):
    """`mamba_selective_scan` with the sequential loop priced (module doc); where the original would
    take another path (mambapy, the associative scan, the last state for a cache) it runs."""
    import torch
    import torch.nn.functional as F

    scan = _scan_function(sizes, where)

    def selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       return_last_state=False, use_mambapy=False, use_associative_scan=False, **kwargs):
        # The function's own tests for its other paths: mambapy's pscan where installed, the
        # associative scan only while torch.compile traces (is_torchdynamo_compiling).
        from transformers.utils.import_utils import is_mambapy_available, is_torchdynamo_compiling

        if return_last_state or (use_mambapy and is_mambapy_available()) \
                or (use_associative_scan and is_torchdynamo_compiling()):
            return original(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias,
                            delta_softplus=delta_softplus, return_last_state=return_last_state,
                            use_mambapy=use_mambapy, use_associative_scan=use_associative_scan, **kwargs)
        # transformers/models/mamba/modeling_mamba.py mamba_selective_scan, line for line but the loop
        if delta_bias is not None:
            dt = dt + delta_bias.to(dt.dtype)[..., None]
        if delta_softplus:
            dt = F.softplus(dt)
        B = B.transpose(1, 2)
        C = C.transpose(1, 2)
        discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
        discrete_B = dt[:, :, :, None] * B[:, None, :, :].float()
        deltaB_u = discrete_B * hidden_states[:, :, :, None].float()
        scan_output = scan.apply(discrete_A, deltaB_u, C, hidden_states.new_empty((), dtype=hidden_states.dtype))
        if D is not None:
            scan_output = scan_output + hidden_states * D[None, :, None]
        if z is not None:
            scan_output = scan_output * F.silu(z)
        return scan_output

    return selective_scan


@contextlib.contextmanager
def priced_scans(where=lambda: ""):
    """Swap every SCAN_MODULES' `mamba_selective_scan` for its priced form, then restore it. Yields
    a list that receives, per scan run, (where(), the bytes its backward holds beyond the saved
    tensors): `where` names the region it ran in (the trace's current block)."""
    import importlib

    restore, sizes = [], []
    try:
        for name in SCAN_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            original = getattr(module, "mamba_selective_scan", None)
            if original is not None:
                restore.append((module, original))
                module.mamba_selective_scan = priced_selective_scan(original, sizes, where)
        yield sizes
    finally:
        for module, original in restore:
            module.mamba_selective_scan = original
