"""The end-of-run report: measured peak memory and throughput next to the plan's prediction."""
from __future__ import annotations

from memkit.plan.plan import TrainingPlan
from memkit.units import format_bytes

# measured key -> (plan.json section, predicted key). MemoryEstimate.allocated_peak_bytes is what
# torch.cuda.max_memory_allocated reports; reserved_peak_bytes what max_memory_reserved reports;
# nvidia_smi_peak_bytes adds the CUDA context (compared with cudaMemGetInfo's used bytes).
COMPARED = (
    ("allocated_peak_bytes", "estimate", "allocated_peak_bytes"),
    ("reserved_peak_bytes", "estimate", "reserved_peak_bytes"),
    ("device_used_peak_bytes", "estimate", "nvidia_smi_peak_bytes"),
    ("tokens_per_s", "step_time", "tokens_per_s"),
    ("step_time_s", "step_time", "step_time_s"),
    ("mfu", "step_time", "mfu"),
)


def predicted_figures(plan_doc: dict | None) -> dict:
    out: dict = {}
    if not plan_doc:
        return out
    for measured_key, section, key in COMPARED:
        value = (plan_doc.get(section) or {}).get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[measured_key] = value
    return out


def cpu_priced(plan_doc: dict, plan: TrainingPlan, config_path, *, spec=None) -> dict:
    """plan.json with its memory estimate priced for the CPU (estimate_memory(device='cpu')): on a
    CPU the runner measures live tensors, which the CPU estimate predicts, while plan.json's
    estimate is for the GPU (CUDA context, cuBLAS workspace, caching-allocator rounding); comparing
    those two was the 0.59x "disagreement" of issue #15's tiny ZeRO-1 plan. The step-time figures
    stay the GPU's (there is no CPU step-time model)."""
    from memkit.emit.plan_doc import hardware_from_dict
    from memkit.estimate.memory import estimate_memory
    from memkit.spec.hf import load_model_spec

    hardware = hardware_from_dict(plan_doc["hardware"])
    est = estimate_memory(spec if spec is not None else load_model_spec(str(config_path)), plan, hardware,
                          device="cpu")
    figures = {k: v for k, v in est.to_dict().items()  # a CPU has no reserved pool and no CUDA context
               if k not in ("reserved_peak_bytes", "nvidia_smi_peak_bytes")}
    return {**plan_doc, "estimate": figures, "estimate_device": "cpu"}


def build_report(*, status: str, plan: TrainingPlan, plan_doc: dict | None, steps_done: int,
                 start_step: int, losses: list[float], measured: dict, world_size: int,
                 distributed_type: str, final_dir: str | None, error: str | None = None) -> dict:
    predicted = predicted_figures(plan_doc)
    ratio = {k: measured[k] / v for k, v in predicted.items()
             if measured.get(k) is not None and v}
    return {"status": status, "steps_done": steps_done, "start_step": start_step,
            "predicted_memory_for": (plan_doc or {}).get("estimate_device", "gpu"),
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "world_size": world_size, "distributed_type": distributed_type, "plan": plan.to_dict(),
            "measured": measured, "predicted": predicted, "measured_over_predicted": ratio,
            "final_dir": final_dir, "error": error}


def _fmt(key: str, value) -> str:
    if value is None:
        return "-"
    if key.endswith("_bytes"):
        return format_bytes(value)
    if key == "mfu":
        return f"{value:.1%}"
    if key == "tokens_per_s":
        return f"{value:,.0f}"
    if key.endswith("_s"):
        return f"{value:.3f}"
    return str(value)


def render_report(report: dict) -> str:
    """A small table: figure | measured | predicted | measured/predicted."""
    measured, predicted, ratio = report["measured"], report["predicted"], report["measured_over_predicted"]
    kind = measured.get("memory_kind")
    priced = "; vs the CPU estimate" if report.get("predicted_memory_for") == "cpu" else ""
    rows = [("figure", "measured", "predicted", "ratio")]
    for key, _, _ in (("host_rss_peak_bytes", None, None),) + tuple(COMPARED):
        if measured.get(key) is None and key not in predicted:
            continue
        label = key
        if key == "allocated_peak_bytes" and kind == "live-tensors":
            label = f"allocated_peak_bytes (live tensors, CPU{priced})"
        rows.append((label, _fmt(key, measured.get(key)), _fmt(key, predicted.get(key)),
                     f"{ratio[key]:.2f}" if key in ratio else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"memkit run report: {report['status']}, {report['steps_done']} steps "
             f"({report['world_size']} x {report['distributed_type']})"]
    if report.get("last_loss") is not None:
        lines.append(f"loss {report['first_loss']:.4f} -> {report['last_loss']:.4f}")
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    if report.get("final_dir"):
        lines.append(f"model saved to {report['final_dir']}")
    if report.get("error"):
        lines.append(f"error: {report['error']}")
    return "\n".join(lines)
