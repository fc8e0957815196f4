"""plan.json, the one plan document: built here (from a search result), written here (as text),
read here (from a file, checked), and the Hardware it was made for rebuilt here. `memkit suggest`,
the preset generator, `memkit explain` / `verify` / `launch-script` and the runner all go
through this module; none of them builds or parses the document itself.

Format (format_version 1): model, hardware, request, plan, label, estimate, step_time, engines,
trainer_arguments, alternatives, rejected, notes, versions; suggest adds budget_bytes,
split_reason, split_limits and search.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from memkit.emit.trainer import bnb_config_kwargs, trainer_arguments
from memkit.errors import MemkitError
from memkit.plan.parallel import engines, split_limits
from memkit.plan.plan_schema import PLAN_FORMAT_VERSION, versions  # noqa: F401 (the document's format and versions)
from memkit.plan.plan import DEFAULT_LR, TrainingPlan  # noqa: F401 (DEFAULT_LR: suggest, presets, bundle import it here)
from memkit.spec.hardware import Hardware, custom_gpu, find_gpu
from memkit.spec.hf_config import task_class
VERSION_KEYS = ("versions",)
"""Keys that differ between machines that made the same plan (installed versions)."""


# ---- hardware ----------------------------------------------------------------------------------

def hardware_dict(hardware: Hardware) -> dict:
    """The hardware a plan is made for, as plan.json records it."""
    return {"gpu": hardware.gpu.name, "gpu_memory_bytes": hardware.gpu.memory_bytes,
            "num_gpus_per_node": hardware.num_gpus_per_node, "num_nodes": hardware.num_nodes,
            "host_ram_bytes_per_node": hardware.host_ram_bytes_per_node,
            "nvme_bytes_per_node": hardware.nvme_bytes_per_node, "inter_node_gbps": hardware.inter_node_gbps}


def hardware_from_dict(hw: dict) -> Hardware:
    """The Hardware `hardware_dict` recorded: the catalog GPU by name, or (a --gpu-memory plan) a
    custom GPU of the recorded memory, as the estimate assumed (spec.hardware.custom_gpu)."""
    try:
        gpu = find_gpu(str(hw.get("gpu")))
    except MemkitError:
        if not isinstance(hw.get("gpu_memory_bytes"), int):
            raise MemkitError(f"plan.json hardware names GPU {hw.get('gpu')!r}, which is not in the catalog, and "
                              "no gpu_memory_bytes; regenerate plan.json with memkit suggest") from None
        gpu = custom_gpu(hw["gpu_memory_bytes"])
    optional = {k: hw[k] for k in ("host_ram_bytes_per_node", "nvme_bytes_per_node", "inter_node_gbps") if k in hw}
    return Hardware(gpu=gpu, num_gpus_per_node=int(hw.get("num_gpus_per_node") or 1),
                    num_nodes=int(hw.get("num_nodes") or 1), **optional).validate()


# ---- build -------------------------------------------------------------------------------------

def plan_document(*, model_name: str, plan: TrainingPlan, hardware: dict, memory, speed,
                  request: dict | None = None, alternatives: list[dict] | None = None,
                  rejected: list[dict] | None = None, notes: list[str] | None = None,
                  label: str = "", lr: float = DEFAULT_LR, version_info: dict | None = None,
                  model_class: str = "AutoModelForCausalLM") -> dict:
    """plan.json: the plan, what memkit predicts for it, and what it was made for. `model_class`: the
    transformers Auto class of the model priced (spec/hf_config.py task_class), written unless a causal
    LM; the bundle builds that class and gives LoRA its peft task type (emit/trainer.py lora_config)."""
    return {
        "format_version": PLAN_FORMAT_VERSION,
        "model": model_name,
        **({"model_class": model_class} if model_class != "AutoModelForCausalLM" else {}),
        "hardware": hardware,
        "request": request or {},
        "plan": plan.to_dict(),
        "label": label,
        "estimate": memory.to_dict(),
        "step_time": speed.to_dict(),
        "engines": engines(plan),
        "trainer_arguments": trainer_arguments(plan, lr=lr),
        "alternatives": alternatives or [],
        "rejected": rejected or [],
        "notes": notes or [],
        "versions": versions() if version_info is None else version_info,
        **({"bitsandbytes": bnb_config_kwargs(plan)} if plan.is_quantized else {}),  # memkit/plan/quantize.py
    }


REQUEST_ALWAYS = ("global_batch_size", "seq_len", "headroom", "objective", "attention", "split")
"""Request fields plan.json always records; every other field only when it differs from its default."""
REQUEST_ORDER = REQUEST_ALWAYS + (
    "precision", "optimizer", "zero_stage", "offload_optimizer", "offload_params", "nvme_path", "checkpointing",
    "loss", "max_micro_batch", "tp", "pp", "quantize_base", "allow_offload", "offload_activations",
    "optimizer_in_backward", "allow", "lora_rank", "lora_targets")
"""The key order plan.json has always had (presets are compared byte for byte); fields not named
here follow in declaration order."""


def request_dict(request) -> dict:
    """The workload and the pins of a planner Request: REQUEST_ALWAYS, then each field that differs
    from its default (a pin given; lora_targets with a LoRA rank), in REQUEST_ORDER."""
    from dataclasses import fields

    out = {}
    for f in fields(request):
        value = getattr(request, f.name)
        if f.name in ("model", "hardware") or (f.name == "double_quant" and not request.quantize_base):
            continue
        if f.name in REQUEST_ALWAYS or (bool(request.lora_rank) if f.name == "lora_targets" else value != f.default):
            out[f.name] = list(value) if isinstance(value, tuple) else value
    order = {name: i for i, name in enumerate(REQUEST_ORDER)}
    return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))


def candidate_dict(cand) -> dict:
    return {"label": cand.label, "plan": cand.plan.to_dict(), "tier": cand.tier,
            "nvidia_smi_peak_bytes": cand.memory.nvidia_smi_peak_bytes,
            "reserved_peak_bytes": cand.memory.reserved_peak_bytes,
            "allocated_peak_bytes": cand.memory.allocated_peak_bytes,
            "host_bytes_per_node": cand.memory.host_bytes_per_node,
            "components": dict(cand.memory.components),
            "step_time_s": cand.speed.step_time_s, "tokens_per_s": cand.speed.tokens_per_s, "mfu": cand.speed.mfu}


def rejection_dict(rej) -> dict:
    return {"label": rej.label, "plan": rej.plan.to_dict(), "reason": rej.reason,
            "nvidia_smi_peak_bytes": rej.device_peak_bytes, "host_bytes_per_node": rej.host_bytes_per_node,
            "needs": list(rej.needs), "step_time_s_if_it_fit": rej.step_time_s}


def build(result, *, lr: float = DEFAULT_LR, elapsed_s: float | None = None,
          version_info: dict | None = None) -> dict:
    """plan.json for a planner SearchResult (what `memkit suggest --out` and the presets write)."""
    req = result.request
    chosen = result.chosen
    doc = plan_document(
        model_name=req.model.name, plan=chosen.plan, hardware=hardware_dict(req.hardware), memory=chosen.memory,
        speed=chosen.speed, request=request_dict(req), label=chosen.label, lr=lr,
        alternatives=[candidate_dict(c) for c in result.alternatives],
        rejected=[rejection_dict(r) for r in result.rejected],
        notes=list(result.notes) + ([f"micro-batch limit: {chosen.micro_limit}"] if chosen.micro_limit else []),
        version_info=version_info, model_class=task_class(chosen.plan.task, req.model.auto_class))
    doc["budget_bytes"] = req.budget_bytes
    if result.split_reason:
        doc["split_reason"] = result.split_reason
    if split_limits(chosen.plan):
        doc["split_limits"] = split_limits(chosen.plan)
    doc["search"] = {"num_structures": result.num_structures, "num_memory_estimates": result.num_memory_estimates}
    if elapsed_s is not None:
        doc["search"]["seconds"] = round(elapsed_s, 4)
    return doc


# ---- write and read ----------------------------------------------------------------------------

def to_text(document: dict) -> str:
    """plan.json's text (the bundle writer writes it)."""
    return json.dumps(document, indent=2) + "\n"


def comparable(document: dict) -> dict:
    """The document without what differs between machines (VERSION_KEYS): presets compare so."""
    return {k: v for k, v in document.items() if k not in VERSION_KEYS}


@dataclass(frozen=True, slots=True)
class PlanDocument:
    """A plan.json that was read and checked; `data` is the document as written."""

    data: dict
    path: Path | None = None

    @property
    def plan(self) -> TrainingPlan:
        return TrainingPlan.from_dict(self.data["plan"])

    @property
    def model(self) -> str | None:
        model = self.data.get("model")
        if isinstance(model, dict):  # older hand-written documents
            return model.get("name") or model.get("model")
        return model if isinstance(model, str) else None

    @property
    def model_class(self) -> str:
        """The transformers Auto class of the model priced (build writes it unless a causal LM)."""
        return self.data.get("model_class") or task_class(self.plan.task, "AutoModelForCausalLM")

    @property
    def lr(self) -> float:
        return float((self.data.get("trainer_arguments") or {}).get("learning_rate", DEFAULT_LR))

    def hardware(self) -> Hardware:
        """The Hardware the plan was made for. What a hand-written plan.json leaves out is read
        as one node of A100-80GB (the GPU `custom_gpu` also assumes) holding every rank."""
        hw = dict(self.data.get("hardware") or {})
        hw.setdefault("gpu", "a100-80gb")
        hw.setdefault("num_nodes", 1)
        hw.setdefault("num_gpus_per_node", max(1, self.plan.num_gpus // max(1, int(hw["num_nodes"]))))
        return hardware_from_dict(hw)


def check(doc, *, where: str, require: tuple[str, ...] = ("plan",)) -> PlanDocument:
    """A PlanDocument from plan.json's parsed JSON; MemkitError (one line) when it is not one.
    Every field is checked against memkit.plan.plan_schema: a document `memkit suggest` wrote (it has
    format_version) in full, a version-0 one (hand-written; no format_version) after its
    migration, its plan and hardware."""
    from memkit.plan import plan_schema

    if not isinstance(doc, dict):
        raise MemkitError(f"{where} holds a JSON {type(doc).__name__}: not a memkit plan.json")
    version = plan_schema.check_format(doc, where=where)
    if version == 0:
        doc = plan_schema.migrate(doc)
    missing = [k for k in require if k not in doc]
    if missing:
        raise MemkitError(f"{where} lacks {', '.join(missing)}: not a memkit plan.json; pass the plan.json "
                          "that memkit suggest wrote")
    if not isinstance(doc.get("plan"), dict):
        raise MemkitError(f"{where} has no 'plan' object; pass the plan.json that memkit suggest wrote")
    if version:
        plan_schema.check_plan_document(doc, where=where, require=require)
    else:
        plan_schema.check_legacy_document(doc, where=where)
    return PlanDocument(doc)


def read(path_text: str | Path, *, flag: str = "--plan", require: tuple[str, ...] = ("plan",)) -> PlanDocument:
    """Read and check plan.json at `path_text` (or in that folder); OS, decoding and JSON errors
    are one line (memkit.fileio)."""
    path, doc = _read_json(path_text, flag)
    checked = check(doc, where=f"{flag} {path}" if flag else str(path), require=require)
    return PlanDocument(checked.data, path)


def read_plan_fields(path_text: str | Path, *, flag: str = "--plan") -> dict:
    """The plan fields of a plan.json as written: a bundle's (checked as `read` checks it) or a
    bare TrainingPlan dict (the launch harness's hand-written plans, checked by the caller's
    TrainingPlan.from_dict)."""
    path, doc = _read_json(path_text, flag)
    if isinstance(doc, dict) and "plan" not in doc:
        return dict(doc)
    return dict(check(doc, where=f"{flag} {path}" if flag else str(path)).data["plan"])


def _read_json(path_text: str | Path, flag: str):
    """(the path, its parsed JSON): plan.json at `path_text` or in that folder; OS, decoding and
    JSON errors are one line (memkit.fileio)."""
    from memkit.fileio import read_json

    path = Path(path_text)
    if path.is_dir():
        path = path / "plan.json"
    return path, read_json(path, what=flag, fix="`memkit suggest --out DIR` writes DIR/plan.json")
