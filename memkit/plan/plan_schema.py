"""plan.json's schema: every field memkit reads back, its type and its range, checked where the
file is read (memkit.emit.plan_doc.check), so `explain`, `explain --check`, `verify`, `train
--plan`, `launch-script` and the Trainer callback never run or crash on a hand-edited, foreign or
damaged file. Pure: raises MemkitError (one line: where, the field, the value, the fix), no I/O.

The schema is data (PLAN_FIELDS, SECTIONS), so tests/unit/test_bad_input_matrix.py generates its
mutations from it: every field x wrong type / out of range / missing.

Format versions: 1 is what `memkit suggest --out` writes (PLAN_FORMAT_VERSION below).
A document without "format_version" is the previous layout (memkit before the plan document had
a version, and hand-written files): `migrate` reads it as version 1 (a "model" object becomes its
name; hardware, estimate and step_time are not required). A newer version is refused with the
memkit that wrote it and the one reading it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from importlib import metadata

from memkit.errors import MemkitError

FIX = "fix the file or make it again with memkit suggest --out"
MAX_BUFFER_ELEMENTS = 10**12
"""ZeRO bucket/threshold sizes in elements: DeepSpeed's models say only >= 0
(deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig: Field(..., ge=0)); 10^12 fp32 elements
is 4 TB, beyond any device, so larger is a typo."""
MAX_GPUS = 1024 * 100_000
"""dp x tp x pp at most: --num-gpus (1024 per node) x --num-nodes (100,000), memkit.plan.limits.LIMITS."""
MAX_BYTES = 2**60
"""Any byte count in a plan (1 EiB: beyond any node)."""


@dataclass(frozen=True, slots=True)
class Field:
    """One JSON value: its kind ('int', 'float', 'str', 'bool', 'names', 'object', 'list'), its
    inclusive range for numbers, whether the document must have it."""

    kind: str
    lo: float | None = None
    hi: float | None = None
    required: bool = True

    def error(self, value) -> str | None:
        """Why `value` is not this field's, or None."""
        if self.kind == "bool":
            return None if isinstance(value, bool) else "not true/false"
        if self.kind in ("int", "float"):
            ok = isinstance(value, int if self.kind == "int" else (int, float)) and not isinstance(value, bool)
            if not ok or not math.isfinite(value):
                return f"not {'an integer' if self.kind == 'int' else 'a number'}"
            if self.lo is not None and value < self.lo or self.hi is not None and value > self.hi:
                return f"out of range ({self.lo:,g} to {self.hi:,g})" if self.hi is not None \
                    else f"below {self.lo:g}"
            return None
        if self.kind == "str":
            return None if isinstance(value, str) and value.strip() else "not a non-empty name"
        if self.kind == "names":
            return None if isinstance(value, list) and all(isinstance(v, str) and v for v in value) \
                else "not a list of names"
        if self.kind == "object":
            return None if isinstance(value, dict) else "not an object"
        if self.kind == "list":
            return None if isinstance(value, list) else "not a list"
        raise AssertionError(self.kind)


def _limit(dest: str, kind: str = "int") -> Field:
    """A plan field with the range of its command-line flag (one table: memkit.plan.limits.LIMITS)."""
    from memkit.plan.limits import LIMITS

    lo, hi, _ = LIMITS[dest]
    return Field(kind, lo, hi)


def _plan_fields() -> dict[str, Field]:
    """Every TrainingPlan field. Choices (precision, engine, ...) and cross-field rules are
    TrainingPlan.validate's; here: type and range. Required: the knobs every memkit plan.json has
    had; the others default to TrainingPlan's defaults (DeepSpeed's own)."""
    from memkit.plan.plan import TrainingPlan, knob_kind

    kinds = {"str": "str", "int": "int", "float": "float", "bool": "bool", "tuple": "names"}
    out = {f.name: Field(kinds[knob_kind(f)], required=False) for f in fields(TrainingPlan)}
    out.update({
        "micro_batch_size": _limit("micro_batch_size"), "grad_accum": _limit("grad_accum"),
        "seq_len": _limit("seq_len"), "dp": Field("int", 1, MAX_GPUS), "tp": _limit("tp"), "pp": _limit("pp"),
        "zero_stage": Field("int", 0, 3), "lora_rank": _limit("lora_rank"),
        "lora_alpha": Field("int", 1, _limit("lora_alpha").hi, required=False),
        "lora_dropout": Field("float", 0.0, _limit("lora_dropout", "float").hi, required=False),
        "gradient_clipping": Field("float", 0.0, _limit("gradient_clipping", "float").hi, required=False),
    })
    for name in ("precision", "optimizer", "engine"):
        out[name] = Field("str")
    for name in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                 "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_param_persistence_threshold"):
        out[name] = Field("int", 0, MAX_BUFFER_ELEMENTS, required=False)
    return out


def _bytes(required: bool = True) -> Field:
    return Field("int", 0, MAX_BYTES, required=required)


SECTIONS: dict[str, dict[str, Field]] = {
    "hardware": {"gpu": Field("str"), "num_gpus_per_node": Field("int", 1, 1024),
                 "num_nodes": Field("int", 1, 100_000), "gpu_memory_bytes": Field("int", 2**20, 2**44, False),
                 "host_ram_bytes_per_node": Field("int", 2**20, 2**54, False),
                 "nvme_bytes_per_node": _bytes(False), "inter_node_gbps": Field("float", 0.0, 1e6, False)},
    "estimate": {"nvidia_smi_peak_bytes": _bytes(), "reserved_peak_bytes": _bytes(),
                 "allocated_peak_bytes": _bytes(), "device_total_bytes": Field("int", 1, MAX_BYTES),
                 "host_bytes_per_node": _bytes(), "components": Field("object", required=False),
                 "peak_phase": Field("str", required=False)},
    "step_time": {"tokens_per_s": Field("float", 0.0, 1e15), "step_time_s": Field("float", 1e-12, 1e12),
                  "mfu": Field("float", 0.0, 1.0)},
}
"""Sections of a format-1 document and the fields explain renders from them (GPU and host limits
as --gpu-memory/--host-ram take them, memkit.validate._SIZE_LIMITS)."""
TOP: dict[str, Field] = {
    "model": Field("str"), "plan": Field("object"), "hardware": Field("object"), "estimate": Field("object"),
    "step_time": Field("object"), "label": Field("str", required=False), "alternatives": Field("list", required=False),
    "rejected": Field("list", required=False), "notes": Field("list", required=False),
    "request": Field("object", required=False), "search": Field("object", required=False),
    "budget_bytes": Field("int", 1, MAX_BYTES, required=False), "versions": Field("object", required=False),
    "engines": Field("object", required=False), "trainer_arguments": Field("object", required=False),
    "model_class": Field("str", required=False),  # the transformers Auto class priced (emit/plan_doc.py)
}


def plan_fields() -> dict[str, Field]:
    return _plan_fields()


def _check(value, spec: Field, *, where: str, name: str) -> None:
    reason = spec.error(value)
    if reason:
        raise MemkitError(f"{where}: {name} is {_short(value)}, {reason}; {FIX}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_block(block: dict, specs: dict[str, Field], *, where: str, prefix: str) -> None:
    for key, spec in specs.items():
        if key not in block:
            if spec.required:
                raise MemkitError(f"{where}: {prefix}{key} is missing; {FIX}")
            continue
        _check(block[key], spec, where=where, name=f"{prefix}{key}")


def check_plan_fields(data, *, where: str) -> None:
    """Each field of a plan object has its TrainingPlan type and range (bool is not an int here);
    `required` fields present."""
    if not isinstance(data, dict):
        raise MemkitError(f"{where}: 'plan' is a {type(data).__name__}, not an object; write the file again "
                          "with memkit suggest --out")
    specs = _plan_fields()
    unknown = sorted(set(data) - set(specs))
    if unknown:
        raise MemkitError(f"{where}: plan has unknown keys {unknown}; is it from a newer memkit?")
    _check_block(data, specs, where=where, prefix="plan.")
    if data.get("lora_rank") and not data.get("lora_targets", True):
        raise MemkitError(f"{where}: plan.lora_targets is empty with lora_rank {data['lora_rank']}; {FIX}")


PLAN_FORMAT_VERSION = 1


def versions() -> dict:
    """Installed versions of what the bundle was made for (importlib.metadata: no imports)."""
    out = {}
    for dist in ("memkit", "deepspeed", "accelerate", "torch", "transformers", "peft"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def check_format(doc: dict, *, where: str) -> int:
    """The document's format version, or one line saying who wrote it and what this memkit reads."""
    if "format_version" not in doc:
        return 0
    version = doc["format_version"]
    writer = (doc.get("versions") or {}).get("memkit") if isinstance(doc.get("versions"), dict) else None
    this = versions().get("memkit")
    written = f"written by memkit {writer}" if writer else "written by an unknown memkit"
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise MemkitError(f"{where}: format_version {_short(version)} is not a plan.json format number "
                          f"({written}; this is memkit {this}, which reads format {PLAN_FORMAT_VERSION}); {FIX}")
    if version > PLAN_FORMAT_VERSION:
        raise MemkitError(f"{where}: plan.json format {version}, {written}; this is memkit {this}, which reads "
                          f"format {PLAN_FORMAT_VERSION}: upgrade memkit or make the plan again with this one")
    return version


def migrate(doc: dict) -> dict:
    """A version-0 document (no format_version: hand-written, or from a memkit before the plan
    document had one) as version 1 reads it: "model" may be an object naming the model."""
    out = dict(doc)
    model = out.get("model")
    if isinstance(model, dict):
        out["model"] = model.get("name") or model.get("model")
    return out


def check_hardware_sizes(hw: dict, *, where: str) -> None:
    """What `explain --check` rebuilds the Hardware from: host RAM, and the GPU's memory (a custom GPU)."""
    for key in ("host_ram_bytes_per_node", "gpu_memory_bytes"):
        value = hw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MemkitError(f"{where}: hardware.{key} is {value!r}, not a positive byte count; --check "
                              "needs it (make the file again with memkit suggest --out)")


def _model_blocks(name: str) -> int | None:
    """The model's decoder blocks if memkit can read its config here (catalog name or a local
    folder), else None (explain prints a plan for a model this machine does not have)."""
    try:
        from memkit.spec.hf import load_model_spec

        return load_model_spec(name).total_layers
    except (MemkitError, OSError, ValueError):
        return None


def check_cross_fields(doc: dict, *, where: str):
    """TrainingPlan.validate with what the document knows: the recorded hardware's GPU count
    (dp x tp x pp must equal it) and the model's blocks (checkpointing K <= blocks)."""
    from memkit.plan.plan import TrainingPlan

    hw = doc.get("hardware")
    num_gpus = hw["num_gpus_per_node"] * hw["num_nodes"] if isinstance(hw, dict) and \
        isinstance(hw.get("num_gpus_per_node"), int) and isinstance(hw.get("num_nodes"), int) else None
    blocks = _model_blocks(doc["model"]) if isinstance(doc.get("model"), str) and \
        str(doc["plan"].get("checkpointing", "none")).isdigit() else None
    try:
        return TrainingPlan.from_dict(doc["plan"]).validate(num_gpus=num_gpus, num_blocks=blocks)
    except MemkitError as exc:
        raise MemkitError(f"{where}: {exc}") from None


def check_plan_document(doc: dict, *, where: str, require: tuple[str, ...] = ()):
    """A format-1 document: every field of TOP, SECTIONS and the plan, then the cross-field rules;
    returns the validated TrainingPlan."""
    _check_block(doc, {k: (Field(s.kind) if k in require else s) for k, s in TOP.items()}, where=where, prefix="")
    check_plan_fields(doc["plan"], where=where)
    for section, specs in SECTIONS.items():
        if section in doc:
            _check_block(doc[section], specs, where=where, prefix=f"{section}.")
    components = doc.get("estimate", {}).get("components", {})
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in components.values()):
        raise MemkitError(f"{where}: estimate.components must map names to byte counts; {FIX}")
    if isinstance(doc.get("request"), dict) and "headroom" in doc["request"]:
        _check(doc["request"]["headroom"], Field("float", 0.0, 0.9), where=where, name="request.headroom")
    for key, needed in (("alternatives", ("nvidia_smi_peak_bytes", "tokens_per_s", "step_time_s", "mfu")),
                        ("rejected", ("step_time_s_if_it_fit",))):
        for i, item in enumerate(doc.get(key, [])):
            if not isinstance(item, dict):
                raise MemkitError(f"{where}: {key}[{i}] is not an object; {FIX}")
            for name in needed:
                spec = SECTIONS["step_time"].get(name) or SECTIONS["estimate"].get(name) or \
                    SECTIONS["step_time"]["step_time_s"]
                _check_block(item, {name: spec}, where=where, prefix=f"{key}[{i}].")
    return check_cross_fields(doc, where=where)


def check_legacy_document(doc: dict, *, where: str):
    """A version-0 document (migrated): its plan's fields that are there, its hardware's counts."""
    check_plan_fields(doc["plan"], where=where)
    hw = doc.get("hardware", {})
    if not isinstance(hw, dict):
        raise MemkitError(f"{where}: 'hardware' is not an object; {FIX}")
    _check_block(hw, {k: Field(s.kind, s.lo, s.hi, required=False) for k, s in SECTIONS["hardware"].items()},
                 where=where, prefix="hardware.")
    from memkit.plan.plan import TrainingPlan

    try:
        return TrainingPlan.from_dict(doc["plan"]).validate()
    except MemkitError as exc:
        raise MemkitError(f"{where}: {exc}") from None


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def check_host(name: str, *, what: str) -> str:
    """A host name as launch scripts and accelerate.yaml paste it: an IPv4/IPv6 literal
    (ipaddress), or an RFC 1123 name (Sec. 2.1; labels of letters, digits and inner hyphens, 1-63
    characters each, 253 in all; RFC 1035 Sec. 2.3.4). Nothing else reaches a shell line."""
    import ipaddress

    text = name.strip("[]") if name.startswith("[") else name
    try:  # hex digits, ':' and '.' only: ipaddress also takes an IPv6 scope ("fe80::1%anything")
        if re.fullmatch(r"[0-9A-Fa-f:.]+", text):
            ipaddress.ip_address(text)
            return name
    except ValueError:
        pass
    labels = name[:-1].split(".") if name.endswith(".") else name.split(".")
    if not name or len(name) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise MemkitError(f"{what} {name!r} is not a host name or IP address; use letters, digits, '-' and '.' "
                          "(RFC 1123), e.g. node-01 or 10.0.0.1")
    return name


# ---- ds_config.json and accelerate.yaml ----------------------------------------------------------

DEEPSPEED_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
"""Top-level counts DeepSpeedConfig reads without a model (deepspeed/runtime/config.py,
DeepSpeedConfig._initialize_params via get_scalar_param): each a positive integer or "auto"."""


def _deepspeed_models() -> dict:
    """The blocks of a ds_config.json that DeepSpeed checks with its own pydantic models:
    deepspeed/runtime/zero/config.py (DeepSpeedZeroConfig, via get_zero_config) and
    deepspeed/runtime/precision_config.py (DeepSpeedBF16Config / DeepSpeedFP16Config)."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed logs its accelerator choice on import
        from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return {"zero_optimization": DeepSpeedZeroConfig, "bf16": DeepSpeedBF16Config, "bfloat16": DeepSpeedBF16Config,
            "fp16": DeepSpeedFP16Config}


def _strict_json_type(model, block: dict, *, where: str, prefix: str) -> None:
    """DeepSpeed's models coerce ("2" -> stage 2, "yes" -> True); a hand-edited file gets JSON's
    own types: an int field takes an integer (or an integral number, as DeepSpeed's own 5e7
    defaults are written), a bool field true/false. Nested models are checked the same way."""
    import enum
    import typing

    from pydantic import BaseModel

    for key, value in block.items():
        info = model.model_fields.get(key)
        if info is None or value is None or (isinstance(value, str) and value == "auto"):
            continue
        kinds = [info.annotation, *typing.get_args(info.annotation)]
        name = f"{prefix}{key}"
        if bool in kinds and not isinstance(value, bool):
            raise MemkitError(f"{where}: {name} is {_short(value)}, not true/false; {FIX}")
        intlike = [k for k in kinds if isinstance(k, type) and k is not bool and
                   (issubclass(k, int) or issubclass(k, enum.IntEnum))]  # ZeroStageEnum is (int, Enum)
        if intlike and bool not in kinds and float not in kinds and not (
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and float(value).is_integer()):
            raise MemkitError(f"{where}: {name} is {_short(value)}, not an integer; {FIX}")
        nested = [k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)]
        if nested and isinstance(value, dict):
            _strict_json_type(nested[0], value, where=where, prefix=f"{name}.")


def check_deepspeed_config(ds, *, where: str) -> None:
    """A ds_config.json as DeepSpeed will read it: its batch counts, clipping and optimizer block,
    and the blocks DeepSpeed has models for, validated by those models (one line for the first
    error, naming the field)."""
    import pydantic

    if not isinstance(ds, dict):
        raise MemkitError(f"{where} holds a JSON {type(ds).__name__}, not a DeepSpeed config object; {FIX}")
    for key in DEEPSPEED_BATCH_KEYS:
        if key in ds and ds[key] != "auto":
            _check(ds[key], Field("int", 1, MAX_GPUS * 2**20 * 65_536), where=where, name=key)
    if "gradient_clipping" in ds and ds["gradient_clipping"] != "auto":
        _check(ds["gradient_clipping"], Field("float", 0.0, 1e6), where=where, name="gradient_clipping")
    optimizer = ds.get("optimizer")
    if optimizer is not None and not (isinstance(optimizer, dict) and isinstance(optimizer.get("type"), str)
                                      and isinstance(optimizer.get("params", {}), dict)):
        raise MemkitError(f"{where}: optimizer is {_short(optimizer)}, not an object with a 'type' name and "
                          f"'params'; {FIX}")
    for key, model in _deepspeed_models().items():
        if key not in ds:
            continue
        block = ds[key]
        if not isinstance(block, dict):
            raise MemkitError(f"{where}: {key} is {_short(block)}, not an object; {FIX}")
        _strict_json_type(model, block, where=where, prefix=f"{key}.")
        try:
            model(**block)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first["loc"])
            raise MemkitError(f"{where}: {key}.{loc} is {_short(first.get('input'))}: {first['msg']} "
                              f"(DeepSpeed's {model.__name__}); {FIX}") from None
        except (ValueError, TypeError, AssertionError) as exc:  # a model validator's own check
            raise MemkitError(f"{where}: {key}: {str(exc).splitlines()[0]} (DeepSpeed's {model.__name__}); "
                              f"{FIX}") from None


ACCELERATE_FIELDS: dict[str, Field] = {
    "num_processes": Field("int", 1, MAX_GPUS, required=False), "num_machines": Field("int", 1, 100_000, False),
    "machine_rank": Field("int", 0, 100_000, False), "main_process_port": Field("int", 1, 65_535, False),
    "distributed_type": Field("str", required=False), "mixed_precision": Field("str", required=False),
    "deepspeed_config": Field("object", required=False), "use_cpu": Field("bool", required=False),
}
"""The accelerate.yaml keys memkit and `accelerate launch` read (accelerate/commands/config/
config_args.py, ClusterConfig); ports as --port takes them (RFC 6335 Sec. 6)."""


WRITTEN_ACCELERATE_KEYS = ("compute_environment", "distributed_type", "deepspeed_config", "num_processes",
                           "num_machines", "machine_rank", "main_process_ip", "main_process_port", "rdzv_backend",
                           "same_network", "main_training_function", "use_cpu", "debug", "downcast_bf16",
                           "mixed_precision")
"""Keys memkit's accelerate.yaml has (memkit.emit.accelerate); others are looked up in
Accelerate's ClusterConfig, whose import costs torch's."""
DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "FSDP")
"""accelerate.utils.DistributedType values memkit launches; others are looked up in the enum."""


def check_accelerate_config(acc: dict, *, where: str) -> None:
    """An accelerate.yaml: known keys only (Accelerate's ClusterConfig fields,
    accelerate/commands/config/config_args.py), the counts and names above typed and in range,
    distributed_type one of Accelerate's DistributedType (accelerate/utils/dataclasses.py), the
    rendezvous host a host name (check_host)."""
    others = sorted(set(acc) - set(WRITTEN_ACCELERATE_KEYS))
    if others:
        import dataclasses

        from accelerate.commands.config.config_args import ClusterConfig

        unknown = [k for k in others if k not in {f.name for f in dataclasses.fields(ClusterConfig)}]
        if unknown:
            raise MemkitError(f"{where}: unknown keys {unknown} (not accelerate config fields); {FIX}")
    _check_block(acc, ACCELERATE_FIELDS, where=where, prefix="")
    kind = acc.get("distributed_type")
    if kind is not None and kind not in DISTRIBUTED_TYPES:
        from accelerate.utils import DistributedType

        kinds = {d.value for d in DistributedType}
    if kind is not None and kind not in DISTRIBUTED_TYPES and kind not in kinds:
        raise MemkitError(f"{where}: distributed_type {acc['distributed_type']!r} is not one of Accelerate's "
                          f"({', '.join(sorted(kinds))}); {FIX}")
    if acc.get("main_process_ip") is not None:
        check_host(str(acc["main_process_ip"]), what=f"{where}: main_process_ip")
    deepspeed = acc.get("deepspeed_config") or {}
    name = deepspeed.get("deepspeed_config_file")
    if name is not None and not (isinstance(name, str) and name.strip()):
        raise MemkitError(f"{where}: deepspeed_config.deepspeed_config_file is {_short(name)}, not a path; {FIX}")


# ---- the calibration profile ------------------------------------------------------------------

PROFILE_RUN: dict[str, Field] = {"plan_kind": Field("str"), "predicted": Field("object"), "measured": Field("object"),
                                 "plan": Field("object", required=False),
                                 "predicted_components": Field("object", required=False),
                                 "measured_components": Field("object", required=False)}
"""One run of memkit/profile.py's record_run, as margins() reads it back."""


def check_profile(doc, *, where: str, version: int) -> None:
    """A calibration profile (memkit/profile.py): its format version, and each machine's runs with
    the figures margins() divides (positive byte counts)."""
    fix = "fix it or run `memkit calibrate --reset`"
    if not isinstance(doc, dict) or not isinstance(doc.get("machines"), dict):
        raise MemkitError(f"{where} has no 'machines' table; run `memkit calibrate --reset`")
    found = doc.get("format_version", version)
    if not isinstance(found, int) or isinstance(found, bool) or not 1 <= found <= version:
        raise MemkitError(f"{where}: format_version {_short(found)} is not one this memkit reads ({version}); {fix}")
    for key, machine in doc["machines"].items():
        runs = machine.get("runs") if isinstance(machine, dict) else None
        if not isinstance(runs, list):
            raise MemkitError(f"{where}: machines[{key!r}] has no 'runs' list; {fix}")
        for i, run in enumerate(runs):
            name = f"machines[{key!r}].runs[{i}]"
            if not isinstance(run, dict):
                raise MemkitError(f"{where}: {name} is not an object; {fix}")
            for field, spec in PROFILE_RUN.items():
                if field not in run:
                    if spec.required:
                        raise MemkitError(f"{where}: {name}.{field} is missing; {fix}")
                    continue
                if spec.error(run[field]):
                    raise MemkitError(f"{where}: {name}.{field} is {_short(run[field])}, "
                                      f"{spec.error(run[field])}; {fix}")
            for part in ("predicted", "measured"):
                for figure, value in run[part].items():
                    if Field("float", 1e-300, float(MAX_BYTES)).error(value):
                        raise MemkitError(f"{where}: {name}.{part}.{figure} is {_short(value)}, not a positive byte "
                                          f"count; {fix}")
