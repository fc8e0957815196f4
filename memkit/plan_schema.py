"""A plan.json, checked field by field: the types and values `memkit suggest --out` wrote, so
`explain`, `verify`, `train` and `launch-script` never crash on a hand-edited or damaged file
(a `precision: "fp8"` used to be a KeyError in explain). Pure: raises MemkitError, no I/O.
"""
from __future__ import annotations

import math
from dataclasses import fields

from memkit.errors import MemkitError

_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}


def check_plan_fields(data, *, where: str) -> None:
    """Each field of a plan object has its TrainingPlan type (bool is not an int here)."""
    from memkit.plan import TrainingPlan

    if not isinstance(data, dict):
        raise MemkitError(f"{where}: 'plan' is a {type(data).__name__}, not an object; write the file again "
                          "with memkit suggest --out")
    for field in fields(TrainingPlan):
        if field.name not in data:
            continue
        value = data[field.name]
        kind = str(field.type)
        if kind.startswith("tuple"):
            ok = isinstance(value, list) and all(isinstance(v, str) and v for v in value) \
                and (bool(value) or not data.get("lora_rank"))
        else:
            types = _TYPES.get(kind)
            ok = types is None or (isinstance(value, types) and (kind == "bool" or not isinstance(value, bool)))
            if ok and kind == "float":
                ok = math.isfinite(value)
        if not ok:
            raise MemkitError(f"{where}: plan.{field.name} is {value!r}, not a {kind}; fix the file or make "
                              "it again with memkit suggest --out")


def _number(doc: dict, section: str, key: str, *, where: str, positive: bool = False) -> None:
    block = doc.get(section) if section else doc
    value = block.get(key) if isinstance(block, dict) else None
    good = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if good and positive:
        good = value > 0
    if not good:
        name = f"{section}.{key}" if section else key
        raise MemkitError(f"{where}: {name} is {value!r}, not a {'positive ' if positive else ''}number; "
                          "fix the file or make it again with memkit suggest --out")


def check_hardware_sizes(hw: dict, *, where: str) -> None:
    """What `explain --check` rebuilds the Hardware from: host RAM, and the GPU's memory (a custom GPU)."""
    for key in ("host_ram_bytes_per_node", "gpu_memory_bytes"):
        value = hw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MemkitError(f"{where}: hardware.{key} is {value!r}, not a positive byte count; --check "
                              "needs it (make the file again with memkit suggest --out)")


def check_plan_document(doc: dict, *, where: str):
    """The fields `explain` renders and `verify`/`train` read; returns the validated TrainingPlan."""
    from memkit.plan import TrainingPlan

    check_plan_fields(doc.get("plan"), where=where)
    plan = TrainingPlan.from_dict(doc["plan"]).validate()
    for section in ("hardware", "estimate", "step_time"):
        if not isinstance(doc.get(section), dict):
            raise MemkitError(f"{where}: '{section}' is not an object; make the file again with memkit suggest --out")
    if not isinstance(doc.get("model"), str) or not isinstance(doc["hardware"].get("gpu"), str):
        raise MemkitError(f"{where}: 'model' and 'hardware.gpu' must be names (strings)")
    for key in ("num_gpus_per_node", "num_nodes"):
        value = doc["hardware"].get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MemkitError(f"{where}: hardware.{key} is {value!r}, not a positive integer")
    for key in ("nvidia_smi_peak_bytes", "reserved_peak_bytes", "allocated_peak_bytes", "device_total_bytes",
                "host_bytes_per_node"):
        _number(doc, "estimate", key, where=where)
    for key in ("tokens_per_s", "step_time_s", "mfu"):
        _number(doc, "step_time", key, where=where)
    components = doc["estimate"].get("components", {})
    if not isinstance(components, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in components.values()):
        raise MemkitError(f"{where}: estimate.components must map names to byte counts")
    for optional in ("budget_bytes",):
        if doc.get(optional) is not None:
            _number(doc, "", optional, where=where, positive=True)
    if isinstance(doc.get("request"), dict) and "headroom" in doc["request"]:
        _number(doc, "request", "headroom", where=where)
    for key, needed in (("alternatives", ("nvidia_smi_peak_bytes", "tokens_per_s", "step_time_s", "mfu")),
                        ("rejected", ("step_time_s_if_it_fit",))):
        items = doc.get(key, [])
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise MemkitError(f"{where}: '{key}' must be a list of objects")
        for i, item in enumerate(items):
            for name in needed:
                _number(item, "", name, where=f"{where}: {key}[{i}]", positive=name.startswith("step_time"))
    for key in ("notes",):
        if not isinstance(doc.get(key, []), list):
            raise MemkitError(f"{where}: '{key}' must be a list of strings")
    if doc.get("search") is not None and not isinstance(doc["search"], dict):
        raise MemkitError(f"{where}: 'search' must be an object")
    return plan
