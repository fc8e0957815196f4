"""memkit's check inside a Hugging Face Trainer (or TRL's SFTTrainer): measured peak memory and
tokens/s of every optimizer step next to memkit's prediction, written as one JSON record.

    import memkit
    prediction = memkit.estimate(model.config, gpu="a100-80gb", precision="bf16",
                                 micro_batch_size=4, grad_accum=8, seq_len=2048)
    trainer = Trainer(..., callbacks=[memkit.MemkitCallback("memkit_record.json",
                                                            prediction=prediction, seq_len=2048)])

What "measured peak" is (the record's `memory_kind` says which):
  'cuda'          torch.cuda.max_memory_allocated / _reserved of this process, reset at each
                  step start: the figures MemoryEstimate.allocated_peak_bytes / reserved_peak_bytes
                  predict (memkit.train.report.COMPARED).
  'live-tensors'  on CPU: bytes of live tensor storages (memkit.measure.live_tensors), the CPU
                  analogue of "allocated"; the model's weights are adopted at train start.
  'rss'           on CPU with cpu_memory='rss': the process's peak resident set size
                  (getrusage ru_maxrss; never decreases, includes Python and libraries).
Tokens per step: state.num_input_tokens_seen when TrainingArguments(include_num_input_tokens_seen=
...) counts them, else per-device batch x accumulation x processes x `seq_len` (padded tokens).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from transformers import TrainerCallback

CPU_MEMORY = ("live-tensors", "rss")


class MemkitCallback(TrainerCallback):
    """Record measured peak memory and tokens/s per optimizer step next to a prediction."""

    def __init__(self, path: str | Path = "memkit_record.json", *, prediction=None, plan_json: str | Path | None = None,
                 seq_len: int | None = None, cpu_memory: str = "live-tensors") -> None:
        """prediction: a MemoryEstimate (memkit.estimate) or a dict of figures
        ({'allocated_peak_bytes': ..., 'tokens_per_s': ...}); plan_json: a plan.json written by
        `memkit suggest --out` (its estimate and step_time). seq_len: tokens per sequence, for the
        token count when the Trainer does not count input tokens."""
        if cpu_memory not in CPU_MEMORY:
            raise ValueError(f"cpu_memory={cpu_memory!r}: use one of {CPU_MEMORY}")
        self.path = Path(path)
        self.predicted = _predicted(prediction, plan_json)
        self.seq_len = seq_len
        self.cpu_memory = cpu_memory
        self.steps: list[dict] = []
        self.record: dict | None = None
        self._tracker = None
        self._kind = None
        self._t0 = 0.0
        self._tokens0 = 0

    # ---- TrainerCallback hooks ---------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        import torch

        if torch.cuda.is_available() and args.device.type == "cuda":
            self._kind = "cuda"
        elif self.cpu_memory == "live-tensors":
            from memkit.measure.live_tensors import LiveTensorTracker

            self._kind = "live-tensors"
            self._tracker = LiveTensorTracker(keep_history=False)
            self._tracker.__enter__()  # a dispatch mode: active on this thread until on_train_end
            if model is not None:
                self._tracker.adopt(list(model.parameters()) + list(model.buffers()), "model")
        else:
            self._kind = "rss"

    def on_step_begin(self, args, state, control, **kwargs):
        import torch

        if self._kind == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        elif self._tracker is not None:
            self._tracker.reset_peak()
        self._tokens0 = state.num_input_tokens_seen or 0
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        import torch

        if self._kind == "cuda":
            torch.cuda.synchronize()
        step_time = time.perf_counter() - self._t0
        tokens = self._tokens(args, state)
        entry = {"step": state.global_step, "step_time_s": step_time, "tokens": tokens,
                 "tokens_per_s": tokens / step_time if tokens and step_time > 0 else None}
        entry.update(self._memory())
        self.steps.append(entry)

    def on_train_end(self, args, state, control, **kwargs):
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self._tracker = None
        self.record = self._build_record(args)
        if args.process_index == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.record, indent=1, sort_keys=True))

    # ---- pieces ------------------------------------------------------------------------------
    def _tokens(self, args, state) -> int | None:
        seen = state.num_input_tokens_seen or 0
        if seen > self._tokens0:
            return int(seen - self._tokens0)
        if self.seq_len:
            return (args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
                    * self.seq_len)
        return None

    def _memory(self) -> dict:
        import torch

        from memkit.measure.runtime import host_rss_peak_bytes

        if self._kind == "cuda":
            return {"allocated_peak_bytes": int(torch.cuda.max_memory_allocated()),
                    "reserved_peak_bytes": int(torch.cuda.max_memory_reserved())}
        if self._kind == "live-tensors":
            return {"allocated_peak_bytes": int(self._tracker.peak_bytes)}
        return {"host_rss_peak_bytes": host_rss_peak_bytes()}

    def _build_record(self, args) -> dict:
        from memkit.measure.runtime import steady_median

        key = "host_rss_peak_bytes" if self._kind == "rss" else "allocated_peak_bytes"
        measured = {"memory_kind": self._kind, key: max((s[key] for s in self.steps), default=None)}
        if self._kind == "cuda":
            measured["reserved_peak_bytes"] = max((s["reserved_peak_bytes"] for s in self.steps), default=None)
        speeds = [s["tokens_per_s"] for s in self.steps if s["tokens_per_s"] is not None]
        measured["tokens_per_s"] = steady_median(speeds) if speeds else None
        ratio = {k: measured[k] / v for k, v in self.predicted.items() if measured.get(k) and v}
        return {"measured": measured, "predicted": self.predicted, "measured_over_predicted": ratio,
                "steps": self.steps, "world_size": args.world_size,
                "per_device_train_batch_size": args.per_device_train_batch_size,
                "gradient_accumulation_steps": args.gradient_accumulation_steps}


def _predicted(prediction, plan_json) -> dict:
    """The comparable figures (memkit.train.report.COMPARED) of a MemoryEstimate, a dict or a plan.json."""
    from memkit.train.report import predicted_figures

    if prediction is not None and plan_json is not None:
        raise ValueError("give prediction or plan_json, not both")
    if plan_json is not None:
        return predicted_figures(json.loads(Path(plan_json).read_text()))
    if prediction is None:
        return {}
    figures = prediction.to_dict() if hasattr(prediction, "to_dict") else dict(prediction)
    doc = {"estimate": figures, "step_time": figures}
    return predicted_figures(doc)
