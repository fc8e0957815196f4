"""Write a plan's bundle: accelerate.yaml, ds_config.json, plan.json, README.md and, for LoRA
plans, adapter_config.json (the peft config a Trainer script loads).

The only emitter that writes to disk (plan_doc.read is the one that reads plan.json). `bundle_files` builds the texts (pure, used by the presets
generator and its staleness test); `write_bundle` writes them. Plans that do not run under
DeepSpeed (pipeline parallel) have no ds_config.json: their accelerate.yaml is a plain
multi-process launch and plan.json's "engines" says what runs each split.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from memkit.emit import plan_doc
from memkit.emit.accelerate import accelerate_config
from memkit.emit.deepspeed import deepspeed_config
from memkit.emit.plan_doc import DEFAULT_LR, plan_document, versions  # noqa: F401 (plan.json lives in plan_doc)
from memkit.emit.trainer import PEFT_CONFIG_FILE, trainer_recipe
from memkit.errors import MemkitError
from memkit.plan.plan import TrainingPlan
from memkit.units import GIB

FILES = ("accelerate.yaml", "ds_config.json", "plan.json", "README.md")
LORA_FILES = (PEFT_CONFIG_FILE,)
"""Written for LoRA plans: the peft config a Trainer script loads (memkit.emit.trainer)."""


def file_names(plan: TrainingPlan) -> tuple[str, ...]:
    """The files of `plan`'s bundle: no ds_config.json when the plan does not run under DeepSpeed,
    the peft config when it trains LoRA adapters."""
    names = FILES if plan.engine == "deepspeed" else tuple(f for f in FILES if f != "ds_config.json")
    return names + (LORA_FILES if plan.is_lora else ())


def bundle_files(document: dict, *, out_dir: str, nvme_path: str = "/local_nvme",
                 largest_param_numel: int = 0, main_process_ip: str | None = None) -> dict[str, str]:
    """File name -> text for the four files of a bundle that will live at `out_dir` (as the user
    will type it in the launch command; the YAML refers to the JSON by that path)."""
    import yaml

    doc = plan_doc.PlanDocument(document)
    plan, lr = doc.plan, doc.lr
    hw = document["hardware"]
    files = {}
    ds_path = None
    if plan.engine == "deepspeed":
        ds = deepspeed_config(plan, lr=lr, nvme_path=nvme_path, largest_param_numel=largest_param_numel)
        ds_path = f"{out_dir.rstrip('/')}/ds_config.json"
        files["ds_config.json"] = json.dumps(ds, indent=2) + "\n"
    acc = accelerate_config(plan, deepspeed_config_file=ds_path, num_gpus_per_node=hw["num_gpus_per_node"],
                            num_nodes=hw["num_nodes"], main_process_ip=main_process_ip)
    files["accelerate.yaml"] = yaml.safe_dump(acc, sort_keys=False)
    files["plan.json"] = plan_doc.to_text(document)
    recipe = trainer_recipe(plan, lr=lr, model_class=doc.model_class)
    if recipe.peft_config is not None:
        files[PEFT_CONFIG_FILE] = json.dumps(recipe.peft_config, indent=2) + "\n"
    files["README.md"] = readme(document, out_dir=out_dir.rstrip("/"))
    return {name: files[name] for name in file_names(plan)}


def is_bundle(folder: Path) -> bool:
    """Whether `folder` holds a bundle memkit wrote: its marker is plan.json's format line (a JSON
    object with "format_version", memkit.emit.plan_doc.plan_document)."""
    from memkit.fileio import read_json_object

    try:
        return "format_version" in read_json_object(folder / "plan.json")
    except MemkitError:
        return False


def check_target(out_dir: str, *, force: bool = False) -> None:
    """--out may be new, empty, or a bundle memkit wrote (replaced atomically); a non-empty folder
    without memkit's marker holds the user's files, and is refused unless --force."""
    root = Path(out_dir)
    if force or not root.is_dir():
        return
    try:
        entries = [p.name for p in root.iterdir() if not p.name.startswith(".memkit-")]
    except OSError:
        return  # the write reports it (write_bundle)
    if entries and not is_bundle(root):
        raise MemkitError(f"--out {out_dir} is a non-empty folder that memkit did not write ({len(entries)} "
                          f"entr{'y' if len(entries) == 1 else 'ies'}, no memkit plan.json); pick a new or empty "
                          "folder, or pass --force to write the bundle files there")


def write_bundle(out_dir: str, files: dict[str, str], *, force: bool = False) -> list[Path]:
    """Write `files` into `out_dir` all or nothing; bundle files the new plan lacks (a stale
    ds_config.json after a pipeline plan) are removed. Other files in the folder are left alone.
    A non-empty folder memkit did not write is refused unless `force` (check_target).

    Each file is written and fsynced in a temporary folder inside `out_dir` first, and the old
    bundle files are hard-linked aside; only then is each moved into place with os.replace (atomic
    per file; POSIX.1-2017, rename). If any step fails, the old files are put back, so a failed
    `suggest` leaves `--out` exactly as it was (a folder it had to create is removed again).
    """
    import os
    import shutil
    import tempfile

    check_target(out_dir, force=force)
    root = Path(out_dir)
    created = [p for p in [root, *root.parents] if not p.exists()]
    if root.exists() and not root.is_dir():
        raise MemkitError(f"--out {out_dir} is a file, not a folder; pick a folder path")
    for name in FILES:
        if (root / name).exists() and not (root / name).is_file():
            raise MemkitError(f"--out {out_dir}: {root / name} is not a regular file; move it away or pick "
                              "another folder")
    try:
        root.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=".memkit-bundle-", dir=root))
    except OSError as exc:
        for folder in created:
            _rmdir_quietly(folder)
        raise MemkitError(f"--out {out_dir}: cannot create the folder ({exc.strerror}); pick a writable path") from None
    moved: list[str] = []
    removed: list[str] = []
    try:
        for name, text in files.items():
            with open(stage / name, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
        (stage / "old").mkdir()
        for name in FILES:
            if (root / name).is_file():
                os.link(root / name, stage / "old" / name)
        for name in files:
            os.replace(stage / name, root / name)
            moved.append(name)
        for name in FILES:
            if name not in files and (root / name).is_file():
                os.unlink(root / name)
                removed.append(name)
    except OSError as exc:
        for name in moved + removed:  # put the old bundle back
            old = stage / "old" / name
            if old.is_file():
                os.replace(old, root / name)
            elif (root / name).is_file():
                os.unlink(root / name)
        shutil.rmtree(stage, ignore_errors=True)
        for folder in created:
            _rmdir_quietly(folder)
        raise MemkitError(f"--out {out_dir}: cannot write the bundle ({exc.strerror or exc}); nothing was "
                          "changed; pick a writable folder") from None
    shutil.rmtree(stage, ignore_errors=True)
    return [root / name for name in files]


def _rmdir_quietly(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass


def model_argument(document: dict) -> str:
    """What the printed command passes as --model: the real weights. A catalog name is only a
    config, so the command names its hub id (the runner loads it once `hf download` has put it in
    the local HF cache, memkit.spec.resolve); a path or hub id is passed as the plan was made with."""
    from memkit.spec.hf import find_catalog_model

    entry = find_catalog_model(str(document["model"]))
    return entry.hub_id if entry is not None and entry.hub_id else str(document["model"])


def _model_flags(document: dict) -> str:
    """--model, and --trust-remote-code when the plan was made under it (plan.json's trust_remote_code:
    the runner builds the folder's own code only when told again, memkit/train/model.py load_config)."""
    import shlex

    trust = " --trust-remote-code" if document.get("trust_remote_code") else ""
    return f"--model {shlex.quote(model_argument(document))}{trust}"


def launch_command(document: dict, *, out_dir: str, data: str = "train.jsonl",
                   extra: str = "", smoke: bool = False) -> str:
    """The command that runs the bundle (the runner module memkit.finetune: `--help` lists its flags).
    smoke=True: 20 steps of synthetic tokens on fresh weights (--init random: nothing to download)."""
    import shlex

    q = shlex.quote
    run = "run"
    if smoke:  # its own folder: the real run then starts fresh
        data, extra, run = "synthetic", " --init random --max-steps 20" + extra, "smoke"
    return (f"accelerate launch --config_file {q(out_dir + '/accelerate.yaml')} -m memkit.finetune "
            f"--plan {q(out_dir + '/plan.json')} {_model_flags(document)} --data {q(data)} "
            f"--output-dir {q(out_dir + '/' + run)}{extra}")


def train_command(document: dict, *, out_dir: str, data: str = "train.jsonl", extra: str = "",
                  smoke: bool = False) -> str:
    """What memkit prints to run the bundle: `memkit train` (memkit.cli.train), which checks the data,
    model and plan first, starts `launch_command`'s processes underneath and turns an error inside a
    worker into one line, exit 2. --main-process-port is accelerate's rendezvous port (its default,
    memkit.emit.accelerate.DEFAULT_MAIN_PROCESS_PORT); change it when another job on the node holds it."""
    import shlex

    from memkit.emit.accelerate import DEFAULT_MAIN_PROCESS_PORT

    q = shlex.quote
    run = "run"
    if smoke:
        data, extra, run = "synthetic", " --init random --max-steps 20" + extra, "smoke"
    return (f"memkit train --plan {q(out_dir + '/plan.json')} {_model_flags(document)} "
            f"--data {q(data)} --output-dir {q(out_dir + '/' + run)} "
            f"--main-process-port {DEFAULT_MAIN_PROCESS_PORT}{extra}")


def _weights_text(document: dict) -> str:
    hub = model_argument(document)
    if hub != str(document["model"]):  # a catalog name: its hub id
        return (f"`{hub}` loads from the local Hugging Face cache once `hf download {hub}` has fetched it; or "
                f"pass the folder that holds them (`--model /path/to/{hub.split('/')[-1]}`)")
    return "a folder with config.json and safetensors weights, or a hub id in the local Hugging Face cache"


def readme(document: dict, *, out_dir: str) -> str:
    plan = document["plan"]
    est = document["estimate"]
    speed = document["step_time"]
    hw = document["hardware"]
    num_gpus = hw["num_gpus_per_node"] * hw["num_nodes"]
    tokens = plan["micro_batch_size"] * plan["grad_accum"] * plan["dp"] * plan["seq_len"]
    lines = [
        f"# {document['model']} on {num_gpus} x {hw['gpu']}",
        "",
        f"Plan: **{document['label']}** (made by memkit {document['versions'].get('memkit')}).",
        "",
        "```",
        train_command(document, out_dir=out_dir),
        "```",
        "",
        "`memkit train` checks the data, model and plan before any process starts and runs "
        "`accelerate launch` underneath; the same job as a raw accelerate command:",
        "",
        "```",
        launch_command(document, out_dir=out_dir),
        "```",
        "",
        f"`--model` is the weights you fine-tune: {_weights_text(document)}. `--data` takes .jsonl/.json/.csv/"
        ".parquet (text, prompt+completion, alpaca, chat messages / ShareGPT), a .txt or a datasets folder. "
        "A 20-step smoke test on synthetic tokens and fresh weights (`--init random`: nothing to download), "
        "which also reports the measured peak per GPU:",
        "",
        "```",
        train_command(document, out_dir=out_dir, smoke=True),
        "```",
        "",
        *alloc_conf_lines(document["plan"]),
    ]
    if hw["num_nodes"] > 1:
        lines += [
            f"Multi-node: run the same command on each of the {hw['num_nodes']} nodes, adding "
            "`--machine_rank i --main_process_ip <node 0 address>` (node 0 has rank 0).",
            "",
        ]
    lines += [
        "| | |", "|---|---|",
        f"| global batch | micro {plan['micro_batch_size']} x accum {plan['grad_accum']} x dp {plan['dp']} = "
        f"{plan['micro_batch_size'] * plan['grad_accum'] * plan['dp']} sequences of {plan['seq_len']} tokens "
        f"= {tokens:,} tokens |",
        f"| precision / optimizer | {plan['precision']} / {plan['optimizer']} |",
        f"| ZeRO | stage {plan['zero_stage']}, optimizer offload {plan['offload_optimizer']}, "
        f"param offload {plan['offload_params']} |",
        f"| checkpointing / attention | {_checkpointing_text(plan['checkpointing'])} / {plan['attention']} |",
        f"| loss | {plan.get('loss', 'standard')} |",
        *backward_rows(plan),
        f"| tp / pp / dp | {plan['tp']} / {plan['pp']} / {plan['dp']} |",
    ]
    for split, how in (document.get("engines") or {}).items():
        if how and split in ("tensor_parallel", "pipeline_parallel"):
            lines.append(f"| {split.replace('_', ' ')} | {how} |")
    if plan["lora_rank"]:
        lines.append(f"| LoRA | rank {plan['lora_rank']}, alpha {plan['lora_alpha']}, "
                     f"targets {', '.join(plan['lora_targets'])} |")
    if plan.get("quantize_base", "none") != "none":
        lines.append(f"| 4-bit base | {plan['quantize_base']}, double quant "
                     f"{'on' if plan.get('double_quant', True) else 'off'} (bitsandbytes; memkit/plan/quantize.py) |")
    lines += [
        f"| predicted peak per GPU | {est['nvidia_smi_peak_bytes'] / GIB:.1f} GiB as nvidia-smi shows it "
        f"({est['reserved_peak_bytes'] / GIB:.1f} reserved, {est['allocated_peak_bytes'] / GIB:.1f} allocated) "
        f"of {est['device_total_bytes'] / GIB:.1f} GiB, in {est['peak_phase']} |",
        f"| host RAM per node | {est['host_bytes_per_node'] / GIB:.1f} GiB |",
        f"| predicted speed | {speed['tokens_per_s']:,.0f} tokens/s, {speed['step_time_s']:.2f} s/step, "
        f"MFU {speed['mfu']:.0%} |",
        "",
    ]
    if plan["engine"] == "deepspeed":
        lines += [
            "Files: `accelerate.yaml` (processes and machines; it points at the DeepSpeed file and sets "
            "nothing else), `ds_config.json` (every DeepSpeed setting, explicit values), `plan.json` "
            "(the plan, memkit's estimate and the versions it was made with; `memkit explain "
            f"{shlex.quote(out_dir + '/plan.json')}` prints it).",
            "",
        ]
        if plan["tp"] == 1:
            lines += trainer_section(document, out_dir=out_dir)
        else:
            lines += ["Under AutoTP, DeepSpeed counts every process in its batch check, so "
                      "`train_batch_size` in ds_config.json is micro x accum x dp x tp; only dp shards "
                      "see distinct data (launch/finetune.py feeds a TP group one batch).", ""]
    else:
        lines += [
            "Files: `accelerate.yaml` (a plain multi-process launch: no DeepSpeed; launch/finetune.py "
            "splits the model into pipeline stages itself), `plan.json` (the plan, memkit's estimate, "
            f"which engine runs each split; `memkit explain {shlex.quote(out_dir + '/plan.json')}` prints it).",
            "",
        ]
        if plan.get("quantize_base", "none") != "none":  # a 4-bit base runs on plain PyTorch (memkit/plan/quantize.py)
            lines += trainer_section(document, out_dir=out_dir)
    if plan["optimizer"] in ("adamw-8bit", "paged-adamw-8bit", "adafactor"):
        lines += [f"The optimizer ({plan['optimizer']}) is built by the training script, not by DeepSpeed; "
                  "the config allows that (`zero_allow_untested_optimizer`).", ""]
    lines += backward_paragraphs(plan)
    if plan["offload_optimizer"] == "nvme" or plan["offload_params"] == "nvme":
        lines += ["NVMe offload writes to the `nvme_path` in ds_config.json: it must be a fast local "
                  "NVMe mount on every node.", ""]
    return "\n".join(lines)


def alloc_conf_lines(plan: dict) -> list[str]:
    """The allocator the plan was priced with (TrainingPlan.alloc_conf): memkit's runner sets it itself
    (memkit/train/main.py set_alloc_conf); a script of one's own exports it."""
    from memkit.plan.plan import ALLOC_CONF_ENV, TrainingPlan

    setting = plan.get("alloc_conf", TrainingPlan().alloc_conf)
    if not ALLOC_CONF_ENV[setting]:
        return ["This plan was priced with torch's default allocator segments (`--alloc-conf default`): leave "
                "`PYTORCH_CUDA_ALLOC_CONF` unset (launch/finetune.py then sets nothing).", ""]
    env = ALLOC_CONF_ENV[setting]
    return [f"This plan runs with `PYTORCH_CUDA_ALLOC_CONF={env}` (`--alloc-conf {setting}`), priced by torch's "
            "default-segment replay, the side measured runs bear out (memkit/estimate/memory.py, "
            "EXPANDABLE_REPLAY_IN_ESTIMATES); launch/finetune.py sets it unless you set it (batches of changing "
            "shapes then strand no cached segments); with a training script of your own, export it first:",
            "", "```",
            f"export PYTORCH_CUDA_ALLOC_CONF={env}", "```", ""]


def trainer_section(document: dict, *, out_dir: str) -> list[str]:
    """README lines for a user's own HF Trainer script: every flag, model kwarg and file the plan
    needs (memkit.emit.trainer.trainer_recipe; tests/unit/test_trainer_fidelity.py runs them)."""
    doc = plan_doc.PlanDocument(document)
    plan = doc.plan
    recipe = trainer_recipe(plan, lr=doc.lr, model_class=doc.model_class)
    kwargs = ", ".join(f"{k}={v!r}" for k, v in recipe.model_kwargs.items())
    from memkit.spec.hf import find_catalog_model

    entry = find_catalog_model(str(document["model"]))
    checkpoint = entry.hub_id if entry is not None else document["model"]  # a catalog name is no hub id
    if recipe.quantization is not None:
        return _quantized_trainer_lines(recipe, checkpoint=checkpoint, kwargs=kwargs, out_dir=out_dir)
    lines = [
        "With Hugging Face Trainer instead, pass these TrainingArguments (ds_config.json decides ZeRO, offload "
        "and the 16-bit mode; Trainer checks the batch, clipping, optimizer and precision flags against it):",
        "",
        "```",
        " ".join(recipe.flags(deepspeed_path=shlex.quote(f"{out_dir}/ds_config.json"))),
        "```",
        "",
        "and build the model the plan was priced with (after TrainingArguments, so that ZeRO-3 partitions it "
        "while loading):",
        "",
        "```python",
        f"model = {recipe.model_class}.from_pretrained({checkpoint!r}, {kwargs})",
        *recipe.model_code,
    ]
    if recipe.peft_config is not None:
        lines += ["from peft import LoraConfig, get_peft_model",
                  f"model = get_peft_model(model, LoraConfig.from_pretrained({out_dir!r}))  # {PEFT_CONFIG_FILE}"]
    lines += ["```", "", f"Tokenize or pack the data to {recipe.max_length} tokens per sequence.", ""]
    return lines


def _quantized_trainer_lines(recipe, *, checkpoint: str, kwargs: str, out_dir: str) -> list[str]:
    """README lines for a 4-bit (QLoRA) base with HF Trainer: Trainer has no flag for it, so the
    BitsAndBytesConfig, prepare_model_for_kbit_training and the peft model are code
    (memkit/train/quantize.py loads the same way; tests/unit/test_qlora_emit.py runs these lines)."""
    dtype = recipe.quantization["bnb_4bit_compute_dtype"]
    lines = [
        "With Hugging Face Trainer instead (no DeepSpeed: a 4-bit base runs on plain PyTorch, DDP across GPUs), "
        "pass these TrainingArguments:",
        "",
        "```",
        " ".join(recipe.flags()),
        "```",
        "",
        "and build the model the plan was priced with: the base loaded in 4 bits by bitsandbytes, prepared for "
        "k-bit training (non-4-bit weights in fp32, frozen), LoRA on top:",
        "",
        "```python",
        "import torch",
        f"from transformers import {recipe.model_class}, BitsAndBytesConfig",
        f"quantization = BitsAndBytesConfig(**{recipe.quantization!r})",
        f"model = {recipe.model_class}.from_pretrained({checkpoint!r}, {kwargs}, quantization_config=quantization, "
        f"dtype=torch.{dtype})",
        *recipe.model_code,
        "from peft import LoraConfig, get_peft_model",
        f"model = get_peft_model(model, LoraConfig.from_pretrained({out_dir!r}))  # {PEFT_CONFIG_FILE}",
        "```",
        "",
        f"Tokenize or pack the data to {recipe.max_length} tokens per sequence. Save with "
        "`model.save_pretrained(DIR)`: peft writes the adapters only; the 4-bit base stays the original checkpoint.",
        "",
    ]
    return lines


def backward_rows(plan: dict) -> list[str]:
    """Table rows for activation offload / the optimizer in backward (memkit/plan/backward_techniques.py)."""
    rows = []
    if plan.get("offload_activations", "none") != "none":
        rows.append(f"| activation offload | {plan['offload_activations']} (saved activations in pinned host RAM) |")
    if plan.get("optimizer_in_backward"):
        rows.append("| optimizer in backward | yes: each parameter steps in its gradient hook; no gradient clipping |")
    return rows


def backward_paragraphs(plan: dict) -> list[str]:
    """How to run the two techniques outside the table: the runner does both; Trainer only offload."""
    out = []
    if plan.get("offload_activations", "none") != "none":
        out += ["Activation offload: launch/finetune.py wraps each forward (and the loss) in "
                "`memkit.train.backward_techniques.OffloadSavedTensors` (torch's save_on_cpu with pinned memory, "
                "parameters not copied, each storage copied once). A Trainer script applies it with "
                "`model = offload_activations(model)` (in the model code above). It needs the host RAM in the "
                "table, pinned, and its copies are not overlapped with compute.", ""]
    if plan.get("optimizer_in_backward"):
        out += ["Optimizer in backward: run it with memkit's runner, the command above (one process, "
                "plain PyTorch; it registers one optimizer per parameter and steps it in "
                "`Tensor.register_post_accumulate_grad_hook`). Hugging Face Trainer has no flag for it and cannot "
                "run it: Trainer steps and clips after backward and builds its LR scheduler on one torch "
                "optimizer, so no TrainingArguments are given for this plan.", ""]
    return out


def _checkpointing_text(value: str) -> str:
    """'3' -> 'first 3 blocks' (memkit/plan/techniques.py: partial checkpointing covers the first K)."""
    from memkit.plan.techniques import CHECKPOINTING

    return value if value in CHECKPOINTING else f"first {value} blocks"
