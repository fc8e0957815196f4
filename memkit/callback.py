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
On a CPU the prediction compared is a CPU one: a plan.json's estimate (priced for its GPU) is
priced again for the CPU from the model the Trainer trains (memkit.train.report.cpu_priced), as
the runner does. At each of the first `log_steps` steps, process 0 prints measured vs predicted
peak and tokens/s to stderr, and warns when the measured peak exceeds the prediction's upper
bound (allocated_peak_upper_bytes: memkit/estimate/bounds.py).
Tokens per step: state.num_input_tokens_seen when TrainingArguments(include_num_input_tokens_seen=
...) counts them, else per-device batch x accumulation x processes x `seq_len` (padded tokens).

The local calibration profile (memkit/profile.py): at train end the measured peaks are appended
to it, as `memkit verify` does, where the profile exists (profile=None) or always (profile=True),
so that a later `memkit estimate` on this device and stack takes its margin from them. That needs
the plan (plan=, or plan_json's) and, on CUDA, the catalog GPU name (gpu=, or plan_json's). A
CPU run calibrates CPU estimates, so its prediction must be priced for the CPU
(memkit.estimate(..., device="cpu")); the record's "profile" says what was written or why not.
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
                 seq_len: int | None = None, cpu_memory: str = "live-tensors", plan=None, gpu: str | None = None,
                 profile: bool | None = None, log_steps: int = 3) -> None:
        """prediction: a MemoryEstimate (memkit.estimate) or a dict of figures
        ({'allocated_peak_bytes': ..., 'tokens_per_s': ...}); plan_json: a plan.json written by
        `memkit suggest --out` (its estimate and step_time). seq_len: tokens per sequence, for the
        token count when the Trainer does not count input tokens. plan: the TrainingPlan the
        prediction is for (plan_json gives its own); gpu: the catalog GPU name this runs on (for the
        profile's key on CUDA). profile: None = add the run to the local calibration profile when
        that file exists; True = always (creating it); False = never."""
        if cpu_memory not in CPU_MEMORY:
            raise ValueError(f"cpu_memory={cpu_memory!r}: use one of {CPU_MEMORY}")
        self.path = Path(path)
        self.predicted = _predicted(prediction, plan_json)
        self._estimate, self._plan, self._gpu = _profile_inputs(prediction, plan_json, plan, gpu)
        self._from_plan_json = plan_json is not None
        self._plan_json = plan_json
        self.log_steps = log_steps
        self.predicted_for = "gpu" if plan_json is not None else None
        self.warnings: list[str] = []
        self.profile = profile
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
            if self._from_plan_json and model is not None:
                self._price_for_cpu(model)
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
        if args.process_index == 0 and len(self.steps) <= self.log_steps:
            self._say(entry)

    def on_train_end(self, args, state, control, **kwargs):
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self._tracker = None
        self.record = self._build_record(args)
        if args.process_index == 0:
            self.record["profile"] = self._feed_profile(self.record["measured"])
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.record, indent=1, sort_keys=True))

    # ---- pieces ------------------------------------------------------------------------------
    def _price_for_cpu(self, model) -> None:
        """plan.json's GPU estimate replaced by the CPU estimate of the same plan and model."""
        from memkit.api import model_spec
        from memkit.emit import plan_doc
        from memkit.train.report import cpu_priced, predicted_figures

        doc = plan_doc.read(self._plan_json, flag="plan_json")
        priced = cpu_priced(doc.data, self._plan or doc.plan, None, spec=model_spec(model))
        self.predicted = predicted_figures(priced)
        self._estimate = dict(priced["estimate"])
        self._from_plan_json = False  # the prediction is now the CPU's
        self.predicted_for = "cpu"

    def _say(self, entry: dict) -> None:
        """One stderr line per early step: measured vs predicted; a warning above the upper bound."""
        import sys

        from memkit.units import format_bytes

        key = "host_rss_peak_bytes" if self._kind == "rss" else "allocated_peak_bytes"
        parts = [f"memkit: step {entry['step']}: peak {format_bytes(entry[key])} ({self._kind})"]
        if self.predicted.get(key):
            parts.append(f"predicted {format_bytes(self.predicted[key])} ({entry[key] / self.predicted[key]:.2f}x)")
        if entry.get("tokens_per_s"):
            speed = f"{entry['tokens_per_s']:,.0f} tokens/s"
            if self.predicted.get("tokens_per_s"):
                speed += f" (predicted {self.predicted['tokens_per_s']:,.0f} on the plan's GPUs)"
            parts.append(speed)
        print(", ".join(parts), file=sys.stderr)
        upper = self._estimate.get("allocated_peak_upper_bytes")
        if key == "allocated_peak_bytes" and upper and entry[key] > upper:
            warning = (f"memkit: WARNING: step {entry['step']} measured peak {format_bytes(entry[key])} is above the "
                       f"prediction's upper bound {format_bytes(upper)}; the plan may not fit on its GPU "
                       "(check the model, batch and sequence length the plan was made for)")
            self.warnings.append(warning)
            print(warning, file=sys.stderr)

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
                "predicted_memory_for": self.predicted_for or ("cpu" if self._kind != "cuda" else "gpu"),
                "warnings": self.warnings,
                "steps": self.steps, "world_size": args.world_size,
                "per_device_train_batch_size": args.per_device_train_batch_size,
                "gradient_accumulation_steps": args.gradient_accumulation_steps}


    def _feed_profile(self, measured: dict) -> dict:
        """Append this run to the local calibration profile (memkit/profile.py), as memkit verify does;
        returns what was done (the record's "profile")."""
        from memkit import profile as local_profile

        path = local_profile.profile_path()
        if self.profile is False or (self.profile is None and not path.is_file()):
            return {"skipped": f"no local profile at {path} (profile=True creates it)"}
        if self._plan is None or not self._estimate.get("allocated_peak_bytes"):
            return {"skipped": "no plan and prediction to compare with (pass plan= and prediction=, or plan_json=)"}
        if self._kind == "rss":
            return {"skipped": "peak RSS is not a figure the estimate predicts (cpu_memory='live-tensors' is)"}
        if self._kind == "live-tensors" and self._from_plan_json:
            return {"skipped": "plan.json's prediction is for a GPU; a CPU run calibrates CPU estimates "
                               "(prediction=memkit.estimate(..., device='cpu'))"}
        device = "cpu" if self._kind == "live-tensors" else self._gpu
        if not device:
            return {"skipped": "the catalog GPU this runs on is unknown (pass gpu='a100-80gb', see `memkit gpus`)"}
        from memkit.spec.stack import installed

        figures = {k: measured.get(k) for k in ("allocated_peak_bytes", "reserved_peak_bytes")}
        runs = local_profile.record_run(device=device, stack=installed(), plan=self._plan, predicted=self._estimate,
                                        measured=figures, path=path)
        return {"path": str(path), "device": device, "runs": runs}


def _profile_inputs(prediction, plan_json, plan, gpu) -> tuple[dict, object, str | None]:
    """(the estimate's dict, the TrainingPlan, the GPU name) the profile record needs."""
    if plan_json is not None:
        from memkit.emit import plan_doc

        doc = plan_doc.read(plan_json, flag="plan_json")
        return dict(doc.data.get("estimate") or {}), plan or doc.plan, gpu or (doc.data.get("hardware") or {}).get("gpu")
    if prediction is None:
        return {}, plan, gpu
    figures = prediction.to_dict() if hasattr(prediction, "to_dict") else dict(prediction)
    return figures, plan, gpu


def _predicted(prediction, plan_json) -> dict:
    """The comparable figures (memkit.train.report.COMPARED) of a MemoryEstimate, a dict or a plan.json."""
    from memkit.train.report import predicted_figures

    if prediction is not None and plan_json is not None:
        raise ValueError("give prediction or plan_json, not both")
    if plan_json is not None:
        from memkit.emit import plan_doc

        return predicted_figures(plan_doc.read(plan_json, flag="plan_json").data)
    if prediction is None:
        return {}
    figures = prediction.to_dict() if hasattr(prediction, "to_dict") else dict(prediction)
    doc = {"estimate": figures, "step_time": figures}
    return predicted_figures(doc)
