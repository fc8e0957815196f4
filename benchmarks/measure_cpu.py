"""Measure peak live-tensor bytes of real training steps on CPU over a matrix of small models and plans.

    python benchmarks/measure_cpu.py --out tests/golden/cpu_measurements.json
    python benchmarks/measure_cpu.py --only single --rows llama-fp32-sdpa --out /tmp/x.json

Single-process rows run in this process (memkit.calibrate.cpu_step); DeepSpeed rows launch
`python -m torch.distributed.run --nproc_per_node 2 -m memkit.calibrate.deepspeed_step` (gloo) and
collect one result per rank. Each output row: id, model config, plan, parameter counts, the
measured figures, and the torch/transformers/deepspeed/peft versions. Existing rows of --out
with other ids are kept, so a subset can be re-measured.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memkit.plan.plan import TrainingPlan  # noqa: E402

# Tiny but not trivial: activations and states both matter (hidden 256, 4 layers, seq 256).
ARCHS: dict[str, dict] = {
    "llama-gqa": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
                  "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
                  "vocab_size": 2000, "max_position_embeddings": 512, "tie_word_embeddings": False},
    # HF GPT-2 defaults kept (dropout 0.1 on embeddings and residuals, tied lm_head) except
    # attention dropout: with dropout_p > 0 CPU SDPA falls back to the math kernel and stores the
    # probabilities like eager, which a GPU's flash / memory-efficient kernels do not.
    "gpt2": {"model_type": "gpt2", "n_embd": 256, "n_layer": 4, "n_head": 8, "vocab_size": 2000,
             "n_positions": 512, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0},
    "qwen2": {"model_type": "qwen2", "hidden_size": 256, "intermediate_size": 688,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
              "vocab_size": 2000, "max_position_embeddings": 512, "tie_word_embeddings": True},
    "gpt-neox": {"model_type": "gpt_neox", "hidden_size": 256, "intermediate_size": 1024,
                 "num_hidden_layers": 4, "num_attention_heads": 8, "vocab_size": 2000,
                 "max_position_embeddings": 512, "rotary_pct": 0.25, "tie_word_embeddings": False,
                 "bos_token_id": 0, "eos_token_id": 0},
}
# Families added with the traced path (issue #14): the same tiny shape, each family's own keys.
_TINY = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "vocab_size": 2000, "max_position_embeddings": 512,
         "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
_MOE = {"moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2}
ARCHS.update({
    "olmo": {"model_type": "olmo", **_TINY},
    "olmo2": {"model_type": "olmo2", **_TINY},
    "cohere": {"model_type": "cohere", **_TINY},
    "starcoder2": {"model_type": "starcoder2", **_TINY},
    "stablelm": {"model_type": "stablelm", **_TINY},
    "granite": {"model_type": "granite", **_TINY},
    "qwen3-moe": {"model_type": "qwen3_moe", **_TINY, **_MOE},
    "qwen2-moe": {"model_type": "qwen2_moe", **_TINY, **_MOE, "shared_expert_intermediate_size": 256},
    "gptj": {"model_type": "gptj", "n_embd": 256, "n_layer": 4, "n_head": 8, "rotary_dim": 16, "n_positions": 512,
             "vocab_size": 2000, "bos_token_id": 0, "eos_token_id": 0},
    "gpt-bigcode": {"model_type": "gpt_bigcode", "n_embd": 256, "n_layer": 4, "n_head": 8, "n_positions": 512,
                    "vocab_size": 2000, "bos_token_id": 0, "eos_token_id": 0},
    "gemma2": {"model_type": "gemma2", **_TINY, "head_dim": 32},
    "falcon-mqa": {"model_type": "falcon", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
                   "multi_query": True, "vocab_size": 2000, "bos_token_id": 0, "eos_token_id": 0},
    "bloom": {"model_type": "bloom", "hidden_size": 256, "n_layer": 4, "n_head": 8, "vocab_size": 2000,
              "bos_token_id": 0, "eos_token_id": 0},
    "opt": {"model_type": "opt", "hidden_size": 256, "ffn_dim": 1024, "num_hidden_layers": 4,
            "num_attention_heads": 8, "vocab_size": 2000, "max_position_embeddings": 512, "word_embed_proj_dim": 256,
            "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1},
    "t5": {"model_type": "t5", "d_model": 256, "d_ff": 1024, "d_kv": 32, "num_layers": 2, "num_heads": 8,
           "vocab_size": 2000, "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1},
})
LORA_TARGETS = {"llama-gqa": ("q_proj", "v_proj"), "gpt2": ("c_attn",), "qwen2": ("q_proj", "v_proj"),
                "gpt-neox": ("query_key_value",)}
NO_SDPA = ("gemma2", "bloom")  # transformers 5 refuses attn_implementation="sdpa" for them
TRACED_FAMILIES = ("olmo", "olmo2", "cohere", "starcoder2", "stablelm", "granite", "qwen3-moe", "qwen2-moe",
                   "gptj", "gpt-bigcode", "gemma2", "falcon-mqa", "bloom", "opt", "t5")

BASE = TrainingPlan(engine="torch", precision="fp32", attention="sdpa", micro_batch_size=2, seq_len=256)


def _single(row_id: str, arch: str, **changes) -> dict:
    extra = {k: changes.pop(k) for k in ("checkpoint_reentrant",) if k in changes}
    if changes.get("lora_rank") and "lora_targets" not in changes:
        changes["lora_targets"] = LORA_TARGETS[arch]
    return {"id": row_id, "kind": "single", "arch": arch, "plan": BASE.with_(**changes), "extra": extra}


SINGLE_ROWS = [
    _single("llama-fp32-eager", "llama-gqa", attention="eager"),
    _single("llama-fp32-sdpa", "llama-gqa"),
    _single("llama-bf16-sdpa", "llama-gqa", precision="bf16"),
    _single("llama-bf16pure-sdpa", "llama-gqa", precision="bf16-pure"),
    _single("llama-fp32-sdpa-ckpt", "llama-gqa", checkpointing="full"),
    _single("llama-fp32-eager-ckpt", "llama-gqa", attention="eager", checkpointing="full"),
    _single("llama-fp32-sdpa-ckpt-reentrant", "llama-gqa", checkpointing="full", checkpoint_reentrant=True),
    _single("llama-bf16-sdpa-ckpt", "llama-gqa", precision="bf16", checkpointing="full"),
    _single("llama-bf16pure-sdpa-ckpt", "llama-gqa", precision="bf16-pure", checkpointing="full"),
    _single("llama-fp32-sdpa-accum2", "llama-gqa", grad_accum=2),
    _single("llama-bf16-sdpa-ckpt-accum2", "llama-gqa", precision="bf16", checkpointing="full", grad_accum=2),
    _single("llama-bf16-eager-micro4-seq128", "llama-gqa", precision="bf16", attention="eager",
            micro_batch_size=4, seq_len=128),
    _single("llama-fp32-sdpa-lora8", "llama-gqa", lora_rank=8),
    _single("llama-bf16-sdpa-lora8-ckpt", "llama-gqa", precision="bf16", lora_rank=8, checkpointing="full"),
    _single("llama-bf16pure-sdpa-lora8", "llama-gqa", precision="bf16-pure", lora_rank=8),
    _single("llama-fp32-sdpa-sgd", "llama-gqa", optimizer="sgd"),
    _single("llama-fp32-sdpa-adafactor", "llama-gqa", optimizer="adafactor"),
    _single("gpt2-fp32-eager", "gpt2", attention="eager"),
    _single("gpt2-fp32-sdpa", "gpt2"),
    _single("gpt2-bf16-sdpa", "gpt2", precision="bf16"),
    _single("gpt2-bf16pure-sdpa-ckpt", "gpt2", precision="bf16-pure", checkpointing="full"),
    _single("gpt2-fp32-sdpa-lora8", "gpt2", lora_rank=8),
    _single("qwen2-fp32-sdpa", "qwen2"),
    _single("qwen2-bf16-eager", "qwen2", precision="bf16", attention="eager"),
    _single("qwen2-bf16-sdpa-ckpt-accum2", "qwen2", precision="bf16", checkpointing="full", grad_accum=2),
    _single("qwen2-bf16pure-sdpa", "qwen2", precision="bf16-pure"),
    _single("qwen2-fp32-sdpa-lora16-all", "qwen2", lora_rank=16,
            lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    # LoRA on every block linear x full checkpointing x bf16 autocast: peft's fp32 cast of the
    # 16-bit inputs (o_proj, down_proj), the adapters' cached bf16 copies and the recompute's
    # unsaved tensors at the widest LoRA'd linear (estimate/tape.py lora_linear).
    *(_single(f"{name}-bf16-sdpa-lora16-all-ckpt", arch, precision="bf16", lora_rank=16, checkpointing="full",
              lora_targets=targets) for name, arch, targets in (
        ("llama", "llama-gqa", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
        ("qwen2", "qwen2", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
        ("neox", "gpt-neox", ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")),
        ("gpt2", "gpt2", ("c_attn", "c_proj", "c_fc")))),
    _single("neox-fp32-sdpa", "gpt-neox"),
    _single("neox-bf16-eager-ckpt", "gpt-neox", precision="bf16", attention="eager", checkpointing="full"),
    _single("neox-bf16pure-sdpa-lora8", "gpt-neox", precision="bf16-pure", lora_rank=8),
] + [row for arch in TRACED_FAMILIES for att in ["eager" if arch in NO_SDPA else "sdpa"] for row in (
    _single(f"{arch}-fp32-{att}", arch, attention=att),
    _single(f"{arch}-bf16-{att}", arch, precision="bf16", attention=att),
    _single(f"{arch}-bf16-{att}-ckpt", arch, precision="bf16", checkpointing="full", attention=att))] + [
    # LoRA through the traced path (peft applied to the traced module)
    _single("olmo2-fp32-sdpa-lora8", "olmo2", lora_rank=8, lora_targets=("q_proj", "v_proj")),
    _single("qwen3-moe-bf16-sdpa-lora8", "qwen3-moe", precision="bf16", lora_rank=8,
            lora_targets=("q_proj", "v_proj")),
    _single("gptj-bf16pure-sdpa-lora8", "gptj", precision="bf16-pure", lora_rank=8,
            lora_targets=("q_proj", "v_proj"))]

# DeepSpeed: 2 ranks, small buckets so they matter without dominating (elements, not bytes).
DS_BASE = TrainingPlan(engine="deepspeed", precision="bf16", attention="sdpa", micro_batch_size=2, seq_len=256,
                       dp=2, reduce_bucket_size=500_000, allgather_bucket_size=500_000,
                       stage3_prefetch_bucket_size=200_000, stage3_max_live_parameters=1_000_000,
                       stage3_max_reuse_distance=1_000_000, stage3_param_persistence_threshold=10_000)


def _ds(row_id: str, arch: str = "llama-gqa", **changes) -> dict:
    return {"id": row_id, "kind": "deepspeed", "arch": arch, "plan": DS_BASE.with_(**changes), "extra": {}}


# The tiny Llama of the runner's tests (tests/e2e/runner_util.py TINY_LLAMA), for the plan `memkit suggest`
# chose for it in issue #15 (--gpu-memory 1GiB --num-gpus 2 --global-batch-size 8 --seq-len 128: ZeRO-1 bf16,
# micro 4, overlap_comm on, 1,000,000-element buckets), where the runner measured 1.22-1.27x the estimate.
ARCHS["llama-tiny"] = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
                       "max_position_embeddings": 256, "tie_word_embeddings": False}


DEEPSPEED_ROWS = [
    _ds("ds-z0-fp32", zero_stage=0, precision="fp32"),
    _ds("ds-z0-bf16", zero_stage=0),
    _ds("ds-z1-fp32", zero_stage=1, precision="fp32"),
    _ds("ds-z1-bf16", zero_stage=1),
    _ds("ds-z2-fp32", zero_stage=2, precision="fp32"),
    _ds("ds-z2-bf16", zero_stage=2),
    _ds("ds-z3-fp32", zero_stage=3, precision="fp32"),
    _ds("ds-z3-bf16", zero_stage=3),
    _ds("ds-z2-bf16-offload", zero_stage=2, offload_optimizer="cpu"),
    _ds("ds-z3-bf16-offload", zero_stage=3, offload_optimizer="cpu"),
    _ds("ds-z2-fp32-offload", zero_stage=2, precision="fp32", offload_optimizer="cpu"),
    _ds("ds-z1-bf16-accum2", zero_stage=1, grad_accum=2),
    _ds("ds-z2-bf16-accum2", zero_stage=2, grad_accum=2),
    _ds("ds-z2-bf16-overlap", zero_stage=2, overlap_comm=True),
    _ds("ds-z1-bf16-overlap", zero_stage=1, overlap_comm=True),
    _ds("ds-z1-bf16-overlap-tiny-suggested", "llama-tiny", zero_stage=1, overlap_comm=True, micro_batch_size=4,
        seq_len=128, reduce_bucket_size=1_000_000, allgather_bucket_size=1_000_000),
    _ds("ds-z2-bf16-ckpt-accum2", zero_stage=2, checkpointing="full", grad_accum=2),
    _ds("ds-z3-bf16-ckpt", zero_stage=3, checkpointing="full"),
]


def versions() -> dict:
    import deepspeed
    import peft
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "deepspeed": deepspeed.__version__, "peft": peft.__version__, "python": sys.version.split()[0]}


def run_single(row: dict, num_steps: int, *, worker: Path = Path(__file__)) -> dict:
    """Measure one row in a fresh process, so nothing an earlier row created or patched (caches
    made outside its tracker, allocator state) can change what this row counts. `worker`: the
    script whose `--single-worker ID` knows the row (measure_cpu_techniques/_qlora/_backward.py
    pass themselves)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, str(worker.resolve()), "--single-worker", row["id"],
               "--steps", str(num_steps), "--out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"{row['id']}: worker failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
        return json.loads(out.read_text())


def _single_worker(row_id: str, num_steps: int, out: Path) -> int:
    from memkit.calibrate.cpu_step import count_params, measure_training

    row = next(r for r in SINGLE_ROWS if r["id"] == row_id)
    config = ARCHS[row["arch"]]
    counts = count_params(config, row["plan"])
    gc.collect()
    measured = measure_training(config, row["plan"], num_steps=num_steps, **row["extra"])
    out.write_text(json.dumps({**counts, "measured": measured}))
    return 0


def run_deepspeed(row: dict, num_steps: int, *, port: int, timeout_s: int = 900) -> dict:
    from memkit.calibrate.cpu_step import count_params

    config = ARCHS[row["arch"]]
    counts = count_params(config, row["plan"].with_(engine="torch", dp=1, zero_stage=0,
                                                    offload_optimizer="none"))
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        (tmp_path / "cfg.json").write_text(json.dumps(config))
        (tmp_path / "plan.json").write_text(json.dumps(row["plan"].to_dict()))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(row["plan"].dp),
               "--master_port", str(port), "-m", "memkit.calibrate.deepspeed_step",
               "--model-config", str(tmp_path / "cfg.json"), "--plan", str(tmp_path / "plan.json"),
               "--out", str(tmp_path / "out"), "--steps", str(num_steps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"{row['id']}: worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-6000:]}")
        ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(row["plan"].dp)]
    return {**counts, "measured": {"ranks": ranks}}


def single_rows_main(argv: list[str] | None, rows: list[dict], *, worker: Path, doc: str,
                     description: str) -> int:
    """main() of a script that measures its own single-process rows with this machinery
    (measure_cpu_arch.py, measure_cpu_backward.py): --out, --rows, --steps, and the worker flag."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--rows", default="", help="comma-separated row ids (default: all)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--single-worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    SINGLE_ROWS[:] = rows  # the worker looks rows up there
    if args.single_worker:
        return _single_worker(args.single_worker, args.steps, args.out)
    chosen = [r for r in rows if not args.rows or r["id"] in set(args.rows.split(","))]
    return measure_rows(chosen, rows, args.out, lambda row: run_single(row, args.steps, worker=worker),
                        description=description)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--only", choices=("single", "deepspeed", "all"), default="all")
    parser.add_argument("--rows", default="", help="comma-separated row ids (default: all)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per row (>= 2)")
    parser.add_argument("--port", type=int, default=29531)
    parser.add_argument("--list", action="store_true", help="print the row ids and exit")
    parser.add_argument("--single-worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.single_worker:
        return _single_worker(args.single_worker, args.steps, args.out)

    rows = [r for r in SINGLE_ROWS + DEEPSPEED_ROWS
            if args.only in ("all", r["kind"] if r["kind"] == "single" else "deepspeed")]
    if args.rows:
        wanted = set(args.rows.split(","))
        unknown = wanted - {r["id"] for r in rows}
        if unknown:
            parser.error(f"unknown row ids {sorted(unknown)}; see --list")
        rows = [r for r in rows if r["id"] in wanted]
    if args.list:
        print("\n".join(r["id"] for r in rows))
        return 0

    def measure(row: dict) -> dict:
        return run_single(row, args.steps) if row["kind"] == "single" else run_deepspeed(row, args.steps, port=args.port)

    return measure_rows(rows, SINGLE_ROWS + DEEPSPEED_ROWS, args.out, measure,
                        description="Peak live-tensor bytes of real CPU training steps; generated by "
                                    "benchmarks/measure_cpu.py")


def measure_rows(rows: list[dict], order: list[dict], out: Path, measure, *, description: str,
                 info: dict | None = None) -> int:
    """Measure `rows` with measure(row) and rewrite the golden file `out` after each one, keeping
    the rows already there, in `order`'s order (what every measure_cpu*.py script writes)."""
    by_id = {r["id"]: r for r in (json.loads(out.read_text())["rows"] if out.exists() else [])}
    info = info or versions()
    for row in rows:
        start = time.time()
        result = measure(row)
        by_id[row["id"]] = {"id": row["id"], "kind": row["kind"], "arch": row["arch"],
                            "model_config": ARCHS[row["arch"]], "plan": row["plan"].to_dict(),
                            **row["extra"], **result, "versions": info}
        measured = result["measured"]
        peak = measured["peak_bytes"] if row["kind"] == "single" else measured["ranks"][0]["peak_bytes"]
        print(f"{row['id']:44s} peak {peak / 2**20:8.2f} MiB  ({time.time() - start:5.1f} s)", flush=True)
        ordered = [by_id[r["id"]] for r in order if r["id"] in by_id]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"description": description, "rows": ordered}, indent=1) + "\n")
        gc.collect()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
