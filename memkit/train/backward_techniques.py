"""The runner's side of activation offload and the optimizer in backward
(rules: memkit/plan/backward_techniques.py; bytes: memkit/estimate/backward_techniques.py).

`OffloadSavedTensors` is `torch.autograd.graph.save_on_cpu(pin_memory=True)` (torch/autograd/graph.py)
with torchtune's two refinements (torchtune/training/_activation_offloading.py): parameters and
their views are not copied (they stay on the device anyway), and a storage saved by several
autograd nodes is copied once (keyed by the storage and its version counter, so an in-place
change between two saves gives a second copy). On a CPU-only machine the saved tensors already
live in host memory: like save_on_cpu (whose `tensor.cpu()` returns a CPU tensor itself) it keeps
them, unless a `store` is given -- the CPU measurements pass one that keeps the bytes outside
torch (numpy), so a LiveTensorTracker sees what a GPU would hold (memkit/calibrate/cpu_step.py).

`OptimizerInBackward` holds one optimizer per trainable parameter and steps it in that
parameter's post-accumulate-grad hook (torch Tensor.register_post_accumulate_grad_hook; torchtune
training/memory.py OptimizerInBackwardWrapper), then frees the gradient; `step()` and
`zero_grad()` are no-ops for the loop, `param_groups` lists every inner group (the loop sets the
learning rate there), and `state_dict()` / `load_state_dict()` cover every inner optimizer.
"""
from __future__ import annotations

import contextlib
import weakref

import torch


class HostStore:
    """Host copies in (pinned, when CUDA is available) torch memory: what the runner uses."""

    def __init__(self, *, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory

    def put(self, raw: torch.Tensor):
        host = torch.empty(raw.numel(), dtype=torch.uint8, pin_memory=self.pin_memory)
        host.copy_(raw, non_blocking=self.pin_memory)
        return host

    def get(self, handle, device: torch.device) -> torch.Tensor:
        return handle.to(device, non_blocking=self.pin_memory)


class NumpyStore:
    """Host copies outside torch's allocations (numpy): a LiveTensorTracker does not see them,
    as the GPU's memory counters would not see pinned host copies. Copies back are torch tensors."""

    def put(self, raw: torch.Tensor):
        return raw.detach().numpy().copy()

    def get(self, handle, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(handle).clone().to(device)


class OffloadSavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: saved tensors go to `store` in forward, come back in backward.
    `moved_bytes`: distinct bytes copied out so far (what the estimator calls offloaded)."""

    def __init__(self, params, *, store=None) -> None:
        param_ptrs = {p.untyped_storage().data_ptr() for p in params if p.numel()}
        self.moved_bytes = 0
        self.num_saved = 0
        copies: dict[tuple[int, int], object] = {}
        host_store = store or HostStore()
        keep_cpu = store is None  # save_on_cpu on a CPU tensor keeps it as it is

        def pack(tensor):
            self.num_saved += 1
            if isinstance(tensor, torch.nn.Parameter) or (keep_cpu and tensor.device.type == "cpu"):
                return tensor
            if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
                return tensor  # subclasses (DTensor, quantized wrappers) and sparse layouts stay as saved
            storage = tensor.untyped_storage()
            if storage.data_ptr() in param_ptrs or storage.nbytes() == 0:
                return tensor
            key = (id(storage), tensor._version)
            handle = copies.get(key)
            if handle is None:
                raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
                handle = host_store.put(raw)
                copies[key] = handle
                weakref.finalize(storage, copies.pop, key, None)
                self.moved_bytes += storage.nbytes()
            return (tensor.device, tensor.dtype, handle, tensor.storage_offset(), tensor.size(), tensor.stride())

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, dtype, handle, offset, size, stride = packed
            raw = host_store.get(handle, device)
            return torch.empty(0, dtype=dtype, device=device).set_(raw.untyped_storage(), offset, size, stride)

        super().__init__(pack, unpack)

    def __enter__(self) -> "OffloadSavedTensors":
        super().__enter__()
        return self


def activation_context(model, plan, *, store=None, copy_on_cpu: bool = False):
    """The forward's context for the plan: OffloadSavedTensors or a null context. `copy_on_cpu`
    (tests): copy CPU tensors too, through a HostStore, so a CPU run exercises pack and unpack."""
    if plan.offload_activations == "none":
        return contextlib.nullcontext()
    if copy_on_cpu and store is None:
        store = HostStore()
    return OffloadSavedTensors(list(model.parameters()), store=store)


class OptimizerInBackward:
    """One optimizer per trainable parameter, stepped in its post-accumulate-grad hook."""

    def __init__(self, params, make_optimizer) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.optimizers = [make_optimizer([p]) for p in self.params]
        self.handles = []
        for param, optimizer in zip(self.params, self.optimizers):
            def step(p, optimizer=optimizer):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            self.handles.append(param.register_post_accumulate_grad_hook(step))

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for optimizer in self.optimizers for p, s in optimizer.state.items()}

    def step(self) -> None:
        """Nothing: each parameter stepped when its gradient landed."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: each gradient was freed after its step."""

    def state_dict(self) -> dict:
        return {"per_parameter": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        for optimizer, inner in zip(self.optimizers, state["per_parameter"], strict=True):
            optimizer.load_state_dict(inner)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def offload_activations(model):
    """`model` whose forward (loss included, as HF models compute it from `labels`) runs under
    OffloadSavedTensors: what the bundle's Trainer recipe applies for --offload-activations cpu."""
    import functools

    forward = model.forward

    @functools.wraps(forward)
    def offloaded(*args, **kwargs):
        with OffloadSavedTensors(list(model.parameters())):
            return forward(*args, **kwargs)

    model.forward = offloaded
    return model
