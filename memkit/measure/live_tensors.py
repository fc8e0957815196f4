"""Peak bytes of live tensors, measured by watching every tensor storage that torch creates.

`LiveTensorTracker` is a TorchDispatchMode: every aten op that runs while it is active hands
its outputs through `__torch_dispatch__`, so every storage an op allocates (factory functions,
op outputs, autograd's gradients, DeepSpeed's flat buffers and gloo collectives' outputs) is
seen once, deduplicated by its `UntypedStorage` (views and in-place results share it), and a
weakref finalizer on that storage subtracts its bytes when torch frees it. The same approach as
torch's own MemTracker (pytorch/pytorch: torch/distributed/_tools/mem_tracker.py), without its
module/optimizer attribution, plus named phases and a record of what was live at each peak.

What it measures: bytes of tensor storages alive at once (what the CUDA caching allocator
calls "allocated", before its 512-byte rounding and without fragmentation or the cache).
Not seen: temporaries allocated and freed inside one C++ kernel (they never reach Python),
storages made outside dispatch (`torch.UntypedStorage(n)`, `torch.frombuffer`), and anything
that existed before the tracker started unless handed to `adopt()`.

Usage:

    with LiveTensorTracker() as tracker:
        with tracker.phase("init"):
            model = build()
        with tracker.phase("forward"):
            loss = model(x).sum()
        ...
    tracker.peak_bytes, tracker.records("forward")[-1].peak_bytes
"""
from __future__ import annotations

import itertools
import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import wraps
from typing import Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

# Tag for storages nobody labelled (activations, temporaries, communication buffers).
UNTAGGED = "other"


@dataclass(slots=True)
class PhaseRecord:
    """One interval between phase marks: live bytes at its start and end, and its peak."""

    name: str
    index: int
    start_live_bytes: int
    end_live_bytes: int = -1
    peak_bytes: int = 0
    peak_seq: int = 0
    """Event number at which the peak was reached (see LiveTensorTracker.live_at)."""

    def to_dict(self) -> dict:
        return {"name": self.name, "index": self.index, "start_live_bytes": self.start_live_bytes,
                "end_live_bytes": self.end_live_bytes, "peak_bytes": self.peak_bytes}


@dataclass(slots=True)
class _Entry:
    """One storage the tracker counts."""

    nbytes: int
    device: str
    born_seq: int
    initial_nbytes: int
    tag: str = UNTAGGED
    site: str = ""
    died_seq: int | None = None
    # Size history for storages resized in place: (seq, nbytes) after each change.
    resizes: list = field(default_factory=list)


class LiveTensorTracker(TorchDispatchMode):
    """Context manager counting the bytes of live tensor storages, their peak, and phases.

    Re-entrant use is not supported; one tracker per process at a time (it patches
    `torch.UntypedStorage.resize_`, which bypasses dispatch, while active).
    """

    def __init__(self, *, keep_history: bool = True, record_sites: bool = False) -> None:
        """record_sites: remember for each storage the first Python frame outside torch that
        allocated it ('deepspeed/runtime/zero/stage_1_and_2.py:initialize_optimizer_states'),
        so live bytes can be grouped by allocation site (see live_at(by='site'))."""
        super().__init__()
        self._record_sites = record_sites
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_seq = 0
        self.live_bytes_by_device: dict[str, int] = {}
        self._keep_history = keep_history
        self._seq = itertools.count(1)
        self._now = 0
        self._entries: dict[int, _Entry] = {}  # id(storage) -> entry, while the storage lives
        self._refs: dict[int, weakref.ref] = {}
        self._history: list[_Entry] = []  # every entry ever counted (for live_at / peak breakdown)
        self._records: list[PhaseRecord] = []
        self._current = self._open("(start)")
        self._orig_resize = None
        self._active = False

    # ---- context manager -------------------------------------------------------------
    def __enter__(self) -> "LiveTensorTracker":
        if self._active:
            raise RuntimeError("LiveTensorTracker is not re-entrant")
        self._active = True
        self._patch_resize()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        self._restore_resize()
        self._active = False
        self._close(self._current)
        return super().__exit__(*exc)

    # ---- phases ------------------------------------------------------------------------
    @contextmanager
    def phase(self, name: str) -> Iterator[PhaseRecord]:
        """Open a named phase: its record keeps live bytes at both ends and the peak within."""
        self._close(self._current)
        record = self._current = self._open(name)
        try:
            yield record
        finally:
            self._close(record)
            self._current = self._open("(between)")

    def records(self, name: str | None = None) -> list[PhaseRecord]:
        """Closed and open phase records, oldest first; only those called `name` if given."""
        return [r for r in self._records if name is None or r.name == name]

    def reset_peak(self) -> None:
        """Forget the overall peak so far (phase records keep theirs)."""
        self.peak_bytes = self.live_bytes
        self.peak_seq = self._now

    # ---- tags and adoption ---------------------------------------------------------------
    def tag(self, tensors: Iterable, label: str, *, adopt: bool = True) -> int:
        """Label the storages of `tensors` (e.g. 'param', 'grad', 'optimizer'); return their bytes.

        A storage the tracker never saw is adopted (counted from now on) when `adopt`.
        Each storage is counted once even if several tensors view it.
        """
        total = 0
        seen: set[int] = set()
        for storage in _storages(tensors):
            key = id(storage)
            if key in seen:
                continue
            seen.add(key)
            entry = self._entries.get(key)
            if entry is None:
                if not adopt:
                    continue
                entry = self._add(storage)
                if entry is None:
                    continue
            entry.tag = label
            total += entry.nbytes
        return total

    def adopt(self, tensors: Iterable, label: str = "adopted") -> int:
        """Count tensors that existed before the tracker started (e.g. model.parameters())."""
        return self.tag(tensors, label, adopt=True)

    def bytes_of(self, tensors: Iterable) -> int:
        """Bytes of the distinct storages behind `tensors` (tracked or not), without tagging."""
        seen: dict[int, int] = {}
        for storage in _storages(tensors):
            seen[id(storage)] = storage.nbytes()
        return sum(seen.values())

    def live_by_tag(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for entry in self._entries.values():
            out[entry.tag] = out.get(entry.tag, 0) + entry.nbytes
        return out

    def live_at(self, seq: int, *, by: str = "tag") -> dict[str, int]:
        """Bytes by tag (or by allocation site, by='site') of the storages alive right after
        event `seq` (e.g. a record's peak_seq).

        Tags are read now, so storages tagged after the event are attributed by their tag.
        """
        if not self._keep_history:
            raise RuntimeError("live_at needs keep_history=True")
        out: dict[str, int] = {}
        for entry in self._history:
            if entry.born_seq <= seq and (entry.died_seq is None or entry.died_seq > seq):
                nbytes = _size_at(entry, seq)
                key = entry.tag if by == "tag" else entry.site
                out[key] = out.get(key, 0) + nbytes
        return out

    def peak_breakdown(self) -> dict[str, int]:
        """Bytes by tag at the overall peak."""
        return self.live_at(self.peak_seq)

    @property
    def now_seq(self) -> int:
        """Number of the latest event (an allocation, free or resize)."""
        return self._now

    def live_born_after(self, seq: int, *, exclude: Iterable = ()) -> int:
        """Bytes of the storages allocated after event `seq` that are still alive, other than
        those behind the tensors in `exclude`."""
        skip = {id(s) for s in _storages(exclude)}
        return sum(e.nbytes for key, e in list(self._entries.items()) if e.born_seq > seq and key not in skip)

    # ---- dispatch -------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten(out)
        for item in flat:
            if isinstance(item, torch.Tensor):
                for storage in _storages([item]):
                    entry = self._entries.get(id(storage))
                    if entry is None:
                        self._add(storage)
                    elif entry.nbytes != storage.nbytes():  # aten.resize_ / set_ grew or shrank it
                        self._resize(entry, storage.nbytes())
        return out

    # ---- internals ------------------------------------------------------------------------
    def _open(self, name: str) -> PhaseRecord:
        record = PhaseRecord(name=name, index=len(self._records), start_live_bytes=self.live_bytes,
                             peak_bytes=self.live_bytes, peak_seq=self._now)
        self._records.append(record)
        return record

    def _close(self, record: PhaseRecord) -> None:
        if record.end_live_bytes < 0:
            record.end_live_bytes = self.live_bytes

    def _tick(self) -> int:
        self._now = next(self._seq)
        return self._now

    def _add(self, storage: torch.UntypedStorage) -> _Entry | None:
        if storage.device.type == "meta":
            return None
        key = id(storage)
        nbytes = storage.nbytes()
        entry = _Entry(nbytes=nbytes, device=str(storage.device), born_seq=self._tick(),
                       initial_nbytes=nbytes, site=_site() if self._record_sites else "")
        self._entries[key] = entry
        self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._on_free(key))
        if self._keep_history:
            self._history.append(entry)
        self._change(entry.device, entry.nbytes)
        return entry

    def _on_free(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        self._refs.pop(key, None)
        if entry is None:
            return
        entry.died_seq = self._tick()
        self._change(entry.device, -entry.nbytes)

    def _resize(self, entry: _Entry, nbytes: int) -> None:
        delta = nbytes - entry.nbytes
        entry.nbytes = nbytes
        entry.resizes.append((self._tick(), nbytes))
        self._change(entry.device, delta)

    def _change(self, device: str, delta: int) -> None:
        self.live_bytes += delta
        self.live_bytes_by_device[device] = self.live_bytes_by_device.get(device, 0) + delta
        if delta > 0:
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
                self.peak_seq = self._now
            record = self._current
            if self.live_bytes > record.peak_bytes:
                record.peak_bytes = self.live_bytes
                record.peak_seq = self._now

    def _patch_resize(self) -> None:
        # UntypedStorage.resize_ does not go through dispatch (same trick as torch's MemTracker).
        self._orig_resize = orig = torch.UntypedStorage.resize_
        tracker = self

        @wraps(orig)
        def resize_(storage, size):
            result = orig(storage, size)
            entry = tracker._entries.get(id(storage))
            if entry is not None and entry.nbytes != storage.nbytes():
                tracker._resize(entry, storage.nbytes())
            return result

        torch.UntypedStorage.resize_ = resize_

    def _restore_resize(self) -> None:
        if self._orig_resize is not None:
            torch.UntypedStorage.resize_ = self._orig_resize
            self._orig_resize = None


def _size_at(entry: _Entry, seq: int) -> int:
    """Size of a storage right after event `seq`, following its in-place resizes."""
    size = entry.initial_nbytes
    for when, nbytes in entry.resizes:
        if when > seq:
            break
        size = nbytes
    return size


# Frames that are machinery, not the allocation's author.
_SKIP = ("/torch/utils/", "/torch/autograd/", "/torch/nn/modules/module.py", "/torch/_tensor.py",
         "/torch/_ops.py", "/torch/overrides.py", "/torch/_dynamo/", "/torch/_compile.py",
         "/torch/optim/optimizer.py", "/torch/distributed/c10d_logger.py", "/live_tensors.py",
         "/contextlib.py", "/functools.py")


def _site() -> str:
    """'package/path.py:function' of the innermost frame that is not dispatch/autograd machinery."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not any(part in filename for part in _SKIP):
            marker = filename.rfind("site-packages/")
            short = filename[marker + 14:] if marker >= 0 else filename.rsplit("/", 2)[-1]
            return f"{short}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "(torch)"


def _storages(tensors: Iterable) -> Iterator[torch.UntypedStorage]:
    """UntypedStorages behind tensors (recursing into wrapper subclasses such as DTensor)."""
    stack = [t for t in tensors if isinstance(t, torch.Tensor)]
    while stack:
        t = stack.pop()
        if is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            stack.extend(v for v in (getattr(t, a) for a in attrs) if isinstance(v, torch.Tensor))
        else:
            yield t.untyped_storage()
