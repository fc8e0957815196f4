"""How often, and why, `memkit suggest` chooses a tensor/pipeline split (issue #8: 282 of 1,435
random plans were splits, 128 of them only because the global batch was not divisible by the
GPU count, 24 for a predicted gain under 5 %). Prints counts; asserts nothing.

    python benchmarks/split_choices.py [--num 1435] [--seed 0]

Requests are random (seeded): a decoder model from the catalog, a catalog GPU, 1-8 GPUs of one
node, a global batch of 1-128 sequences, 512-8192 tokens, LoRA one time in four; tp/pp unpinned,
everything else at suggest's defaults.
"""
from __future__ import annotations

import argparse
import collections
import random

from memkit.errors import MemkitError
from memkit.planner import NoPlanFits, Request, search
from memkit.planner.space import default_lora_targets
from memkit.spec.hardware import Hardware, gpu_catalog
from memkit.spec.hf import load_model_spec, model_catalog


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num", type=int, default=1435)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    models = [load_model_spec(n) for n in model_catalog()]
    models = [m for m in models if m.kind == "decoder"]
    gpus = list(gpu_catalog().values())
    counts: collections.Counter = collections.Counter()
    gains = []
    for _ in range(args.num):
        model = rng.choice(models)
        lora = rng.random() < 0.25
        request = Request(model=model, hardware=Hardware(gpu=rng.choice(gpus), num_gpus_per_node=rng.choice((1, 2, 4, 8))),
                          global_batch_size=rng.randint(1, 128), seq_len=rng.choice((512, 1024, 2048, 4096, 8192)),
                          lora_rank=16 if lora else 0,
                          lora_targets=default_lora_targets(model) if lora else ("q_proj", "v_proj"))
        try:
            result = search(request)
        except NoPlanFits:
            counts["no plan fits"] += 1
            continue
        except MemkitError as exc:
            counts["refused: " + ("batch not met by data parallelism (nearby batches named)"
                                  if "cannot be met exactly" in str(exc) else "other bad request")] += 1
            continue
        plan = result.chosen.plan
        if plan.tp == 1 and plan.pp == 1:
            counts["data parallel"] += 1
            continue
        reason = result.split_reason
        kind = "split: faster" if "faster than the best data-parallel" in reason else "split: does not fit otherwise"
        counts[kind] += 1
        if "x faster" in reason:
            gains.append(float(reason.split(": ", 1)[1].split("x", 1)[0]))
    total = sum(counts.values())
    print(f"{total} random requests (seed {args.seed})")
    for key, value in sorted(counts.items()):
        print(f"  {key:<70} {value:5d}  {value / total:6.1%}")
    if gains:
        print(f"  smallest predicted speed-up of a split chosen for speed: {min(gains):.2f}x")


if __name__ == "__main__":
    main()
