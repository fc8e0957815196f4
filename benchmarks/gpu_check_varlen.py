"""Variable-length LoRA steps on one CUDA GPU, with and without expandable segments: measured
max_memory_reserved against memkit's variable-length replay (memkit/estimate/varlen.py).

    python benchmarks/gpu_check_varlen.py [--model llama-3.2-1b] [--lengths 256,512,768,1024]

Each setting runs in its own process, since PYTORCH_CUDA_ALLOC_CONF is read when the CUDA
allocator starts (c10/cuda/CUDAAllocatorConfig.cpp). The model is built from its config with
fresh bf16 weights (nothing to download), LoRA via peft on q_proj and v_proj, AdamW, bf16 autocast,
one micro-batch per step at each length in turn. The script prints a table and reports; it
asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GIB = 2 ** 30


def child(args) -> int:
    """One run under the PYTORCH_CUDA_ALLOC_CONF this process was started with."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from memkit.spec.resolve import resolve_model

    config = AutoConfig.from_pretrained(str(resolve_model(args.model).config_path.parent))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to("cuda")
    model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                             target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    torch.cuda.reset_peak_memory_stats()
    for length in args.lengths:
        ids = torch.randint(0, config.vocab_size, (args.micro_batch_size, length), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss, ids
    torch.cuda.synchronize()
    print(json.dumps({"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}))
    return 0


def predicted(args) -> dict:
    from memkit.estimate.varlen import estimate_varlen
    from memkit.plan.plan import TrainingPlan
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import load_model_spec

    model = load_model_spec(args.model)
    plan = TrainingPlan(precision="bf16", micro_batch_size=args.micro_batch_size, seq_len=max(args.lengths),
                        lora_rank=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0)
    hw = Hardware(gpu=find_gpu(args.gpu))
    return {ex: estimate_varlen(model, plan, hw, list(args.lengths), expandable_segments=ex) for ex in (False, True)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--gpu", default="h100-80gb", help="memkit GPU catalog name for the prediction")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[256, 512, 768, 1024])
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--predict-only", action="store_true", help="print memkit's figures only (no GPU needed)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    pred = predicted(args)
    rows = []
    for expandable in (False, True):
        measured = None
        if not args.predict_only:
            env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
            if expandable:
                env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
            child_argv = [sys.executable, __file__, "--child", "--model", args.model, "--lengths",
                          ",".join(map(str, args.lengths)), "--micro-batch-size", str(args.micro_batch_size),
                          "--lora-rank", str(args.lora_rank)]
            proc = subprocess.run(child_argv, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
            measured = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
            if measured is None:
                print(f"run failed ({'expandable' if expandable else 'default'}): {proc.stderr.strip()[-300:]}",
                      file=sys.stderr)
        v = pred[expandable]
        rows.append((expandable, measured, v))
    print(f"| segments | lengths | measured reserved | memkit reserved | ratio | memkit one longest shape |")
    print("|---|---|---|---|---|---|")
    for expandable, measured, v in rows:
        m = f"{measured['reserved'] / GIB:.2f}" if measured else "-"
        ratio = f"{measured['reserved'] / v.reserved_peak_bytes:.3f}" if measured else "-"
        print(f"| {'expandable' if expandable else 'default'} | {','.join(map(str, args.lengths))} | {m} | "
              f"{v.reserved_peak_bytes / GIB:.2f} | {ratio} | {v.single_shape_reserved_bytes / GIB:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
