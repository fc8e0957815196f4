"""Generate presets/plans/: ready bundles for common models x GPUs x sequence lengths.

    python -m memkit.presets_gen            # rewrite presets/plans/ and presets/README.md
    python -m memkit.presets_gen --check    # exit 1 if a committed preset is stale (CI does this)

Each preset is what `memkit suggest --out presets/plans/<name>` writes for its request (three
files: accelerate.yaml, ds_config.json, plan.json); presets/README.md tables them. Which
requests: every model x card x {full fine-tuning, LoRA} at 4k tokens, on the fewest GPUs of that
card (1, 2, 4 or 8) that fit it and on a full 8-GPU node; plus 2k and 8k tokens for the 8B model.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from memkit.presets_dir import presets_dir
from memkit.spec.hardware import HOST_RAM_GIB_PER_GPU, MIN_HOST_RAM_GIB
from memkit.units import GIB

MODELS = ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen2.5-14b", "qwen2.5-32b", "llama-3.1-70b")
GPUS = {16: "v100-16gb", 24: "rtx-4090", 40: "a100-40gb", 48: "l40s", 80: "h100-80gb"}
"""One representative card per memory class (GB as sold)."""
COUNTS = (1, 2, 4, 8)
SEQ_LENS = (2048, 4096, 8192)
MAIN_SEQ = 4096
SEQ_SWEEP_MODEL = "llama-3.1-8b"
GLOBAL_BATCH = 64
"""Sequences per optimizer step (64 x 4k = 262k tokens): a common fine-tuning batch."""
LORA_RANK = 16
FILES = ("accelerate.yaml", "ds_config.json", "plan.json", "adapter_config.json")


@dataclass(frozen=True, slots=True)
class PresetRequest:
    model: str
    gpu: str
    num_gpus: int
    seq_len: int
    lora: bool

    @property
    def name(self) -> str:
        mode = f"lora{LORA_RANK}" if self.lora else "full"
        return f"{self.model}-{mode}-{self.num_gpus}x{self.gpu}-{self.seq_len // 1024}k"


    def suggest_argv(self) -> list[str]:
        """The `memkit suggest` arguments of this preset (tests/unit/test_presets_equal_suggest.py runs
        them and compares the files with the committed preset)."""
        argv = ["--model", self.model, "--gpu", self.gpu, "--num-gpus", str(self.num_gpus),
                "--global-batch-size", str(GLOBAL_BATCH), "--seq-len", str(self.seq_len)]
        return argv + (["--lora-rank", str(LORA_RANK)] if self.lora else [])


def _search(req: PresetRequest):
    """The request `memkit suggest` builds from `req.suggest_argv()` (every other flag at its
    default, host RAM included: spec.hardware.default_host_ram_bytes), searched."""
    from memkit.planner import NoPlanFits, Request, search
    from memkit.planner.space import default_lora_targets
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import load_model_spec

    model = load_model_spec(req.model)
    request = Request(model=model, hardware=Hardware(gpu=find_gpu(req.gpu), num_gpus_per_node=req.num_gpus),
                      global_batch_size=GLOBAL_BATCH, seq_len=req.seq_len, lora_rank=LORA_RANK if req.lora else 0,
                      lora_targets=default_lora_targets(model) if req.lora else ("q_proj", "v_proj"))
    try:
        return search(request)
    except NoPlanFits:
        return None


def _groups() -> list[tuple[str, str, bool, int]]:
    """(model, card, LoRA, sequence) of every preset family, in the order the presets are listed."""
    return [(model, gpu, lora, seq) for model in MODELS for gpu in GPUS.values() for lora in (False, True)
            for seq in (SEQ_LENS if model == SEQ_SWEEP_MODEL else (MAIN_SEQ,))]


def _plan_group(group: tuple[str, str, bool, int]):
    """One family: the fewest GPUs that fit, and the full node at the main sequence length.
    Returns ([(request, SearchResult)], [miss])."""
    model, gpu, lora, seq = group
    chosen, misses = [], []
    counts = COUNTS if seq == MAIN_SEQ else COUNTS[:-1]
    found = None
    for n in counts:
        req = PresetRequest(model, gpu, n, seq, lora)
        result = _search(req)
        if result is not None:
            found = result
            chosen.append((req, result))
            break
    if seq == MAIN_SEQ and (found is None or found.request.hardware.num_gpus != 8):
        full_node = PresetRequest(model, gpu, 8, seq, lora)
        result = _search(full_node)
        if result is not None:
            chosen.append((full_node, result))
        elif found is None:
            misses.append(full_node)
    return chosen, misses


def _worker_tasks(groups: list[tuple[str, str, bool, int]]) -> list[list[tuple[str, str, bool, int]]]:
    """`groups` by (model, LoRA, sequence), each one worker's task: its cards search the same plan
    structures, and a worker's memory estimates reuse the replays they share (estimate/memory.py
    _replay: the cards of one cuBLAS workspace replay the same events). Largest model first, so
    that the longest tasks start first and the workers finish together."""
    by_task: dict[tuple, list] = {}
    for g in groups:
        by_task.setdefault((g[0], g[2], g[3]), []).append(g)
    return sorted(by_task.values(), key=lambda task: -MODELS.index(task[0][0]))


def _plan_task(task: list[tuple[str, str, bool, int]]) -> list[tuple]:
    return [_plan_group(g) for g in task]


def plan_presets(*, workers: int | None = None, progress=None) -> tuple[dict[PresetRequest, object], list[PresetRequest]]:
    """(request -> SearchResult for every preset, requests that fit on no count of that card).
    The families are independent searches: `workers` processes share them (default: one per CPU),
    a model's cards in one process (_worker_tasks); `progress(done, total, group)` is called as each finishes."""
    import os

    groups = _groups()
    tasks = _worker_tasks(groups)
    workers = workers or min(len(tasks), os.cpu_count() or 1)
    results: dict[tuple, tuple] = {}

    def finished(task, outs) -> None:
        for g, out in zip(task, outs):
            results[g] = out
            if progress:
                progress(len(results), len(groups), g)

    if workers > 1:
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(_plan_task, fam): i for i, fam in enumerate(tasks)}
            for future in as_completed(futures):
                finished(tasks[futures[future]], future.result())
    else:
        for fam in tasks:
            finished(fam, _plan_task(fam))
    chosen: dict[PresetRequest, object] = {}
    misses: list[PresetRequest] = []
    for g in groups:  # in the families' order, whatever order they finished in
        pairs, missed = results[g]
        chosen.update(pairs)
        misses += missed
    return chosen, misses


def render(chosen, misses) -> dict[str, str]:
    """Relative path under presets/ -> text, for every generated file."""
    from memkit.emit import plan_doc
    from memkit.emit.bundle import bundle_files
    from memkit.emit.deepspeed import largest_param_numel

    files: dict[str, str] = {}
    rows = []
    for req, result in sorted(chosen.items(), key=lambda kv: _order(kv[0])):
        out_dir = f"presets/plans/{req.name}"
        doc = plan_doc.build(result, lr=plan_doc.DEFAULT_LR)
        bundle = bundle_files(doc, out_dir=out_dir, largest_param_numel=largest_param_numel(result.request.model))
        for fname in FILES:
            if fname in bundle:  # a pipeline plan has no ds_config.json, a full fine-tune no adapter_config.json
                files[f"plans/{req.name}/{fname}"] = bundle[fname]
        rows.append((req, doc))
    files["README.md"] = _readme(rows, misses)
    return files


def _order(req: PresetRequest) -> tuple:
    return (MODELS.index(req.model), req.lora, req.seq_len, list(GPUS.values()).index(req.gpu), req.num_gpus)


def _readme(rows, misses) -> str:
    lines = [
        "# memkit presets",
        "",
        "Ready-made plans: each folder under `plans/` holds what `memkit suggest --out presets/plans/<name>",
        "--relative-paths` writes for one request - `accelerate.yaml`, `ds_config.json` (every DeepSpeed",
        "setting, explicit values) and `plan.json` (the plan, memkit's predicted per-GPU peak and speed, and",
        "why cheaper plans were rejected). Their paths are relative to the repository root. To run one from",
        "any directory, write it as a bundle with absolute paths and run the command it prints:",
        "",
        "```",
        "memkit preset <name> --out runs/<name>",
        "memkit train --plan $PWD/runs/<name>/plan.json --model <weights folder or downloaded hub id> \\",
        "    --data train.jsonl --output-dir $PWD/runs/<name>/run --main-process-port 29500",
        "```",
        "",
        "(`memkit train --plan presets/plans/<name>/plan.json ...` also resolves the preset's paths itself;",
        "add `--init random --data synthetic --max-steps 20` for a smoke test on fresh weights. The bundle's",
        "README.md has the same job as a raw `accelerate launch` line; `memkit preset` lists the presets with",
        "their plan, peak and speed.)",
        "",
        "`memkit explain presets/plans/<name>/plan.json` prints a plan in full. All presets assume:",
        f"global batch {GLOBAL_BATCH} sequences (micro x accum x GPUs, exactly), 10% memory headroom, host RAM",
        f"of {HOST_RAM_GIB_PER_GPU} GiB per GPU (at least {MIN_HOST_RAM_GIB} GiB; `memkit suggest`'s default), "
        "one node, AdamW (lr 2e-5) unless nothing with AdamW fits,",
        f"LoRA rank {LORA_RANK} on the attention q/v projections. For other batch sizes, GPU counts or pins,",
        "run `memkit suggest` yourself. Regenerate with `python -m memkit.presets_gen` (a test fails when",
        "a committed preset no longer matches what memkit would suggest).",
        "",
        "Cards: " + ", ".join(f"{gb} GB = {name}" for gb, name in GPUS.items()) + ".",
        "Peak: per-GPU peak as nvidia-smi would show it (predicted). Speed: predicted tokens/s for all GPUs.",
        "",
        "| preset | model | mode | tokens | GPUs | plan | peak GiB | tokens/s |",
        "|---|---|---|---:|---|---|---:|---:|",
    ]
    for req, doc in rows:
        est, speed, hw = doc["estimate"], doc["step_time"], doc["hardware"]
        mode = f"LoRA r{LORA_RANK}" if req.lora else "full"
        lines.append(
            f"| [{req.name}](plans/{req.name}/) | {req.model} | {mode} | {req.seq_len} | {req.num_gpus} x {req.gpu} "
            f"| {doc['label']} | {est['nvidia_smi_peak_bytes'] / GIB:.1f} / {hw['gpu_memory_bytes'] / GIB:.0f} "
            f"| {speed['tokens_per_s']:,.0f} |")
    if misses:
        lines += ["", "Does not fit even on 8 of the card (full node, with the host RAM above):", ""]
        lines += [f"- {m.model}, {'LoRA' if m.lora else 'full'}, {m.seq_len} tokens, {m.gpu}" for m in misses]
    return "\n".join(lines) + "\n"


def _comparable(path: str, text: str):
    """What the staleness check compares: plan.json without its versions (plan_doc.comparable)."""
    from memkit.emit.plan_doc import comparable

    return comparable(json.loads(text)) if path.endswith("plan.json") else text


def stale_files(files: dict[str, str], root: Path) -> list[str]:
    """Generated paths whose committed copy is missing or differs, plus committed plans not generated."""
    stale = [p for p, text in files.items()
             if not (root / p).is_file() or _comparable(p, (root / p).read_text()) != _comparable(p, text)]
    plans = root / "plans"
    if plans.is_dir():
        generated = {p.split("/")[1] for p in files if p.startswith("plans/")}
        stale += [f"plans/{d.name} (not generated any more)" for d in plans.iterdir() if d.name not in generated]
    return stale


def write(files: dict[str, str], root: Path) -> None:
    plans = root / "plans"
    if plans.is_dir():
        shutil.rmtree(plans)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memkit.presets_gen", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale presets (exit 1 if any)")
    args = parser.parse_args(argv)
    root = presets_dir()
    start = time.perf_counter()

    def progress(done: int, total: int, group) -> None:
        model, gpu, lora, seq = group
        print(f"[{done}/{total}] {model} {'LoRA' if lora else 'full'} {seq // 1024}k on {gpu} "
              f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)

    files = render(*plan_presets(progress=progress))
    if args.check:
        stale = stale_files(files, root)
        for path in stale:
            print(f"stale: presets/{path}")
        return 1 if stale else 0
    write(files, root)
    print(f"wrote {sum(1 for p in files if p.endswith('plan.json'))} presets under {root / 'plans'} and "
          f"{root / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
