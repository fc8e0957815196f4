"""Where an activation-offloaded backward peaks: the live bytes at each autograd node of the last
step's backward, measured on CPU with the runner's hook (memkit/train/backward_techniques.py
OffloadSavedTensors into a NumpyStore, as benchmarks/measure_cpu_backward.py does).

    python benchmarks/offload_backward_nodes.py --row gpt2-fp32-sdpa-sgd-micro4-offload

Prints the nodes with the highest peak (live bytes while the node ran: its unpacked saved
tensors, its results and every gradient in flight), which is what estimate/memory.py prices as a
block's backward moment under offload (estimate/activations.py offloaded_backward_bytes).
Node hooks: torch Node.register_prehook / register_hook; the tracker's peak is reset per node.
"""
from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden" / "cpu_measurements_backward.json"


def node_peaks(row: dict, num_steps: int = 2) -> list[tuple[str, int, int]]:
    """(node name, live bytes before it, peak bytes while it ran) for the last step's backward."""
    import torch

    from memkit.calibrate.cpu_step import build_model, build_optimizer, random_batch
    from memkit.measure.live_tensors import LiveTensorTracker
    from memkit.plan.plan import TrainingPlan
    from memkit.train.backward_techniques import NumpyStore, OffloadSavedTensors

    plan = TrainingPlan.from_dict(row["plan"])
    generator = torch.Generator().manual_seed(1)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if plan.precision == "bf16" \
        else contextlib.nullcontext
    nodes: list[tuple[str, int, int]] = []
    with LiveTensorTracker() as tracker:
        model = build_model(row["model_config"], plan)
        optimizer, _ = build_optimizer([p for p in model.parameters() if p.requires_grad], plan)
        for step in range(num_steps):
            batch = random_batch(model.config.vocab_size, plan, generator)
            with autocast(), OffloadSavedTensors(list(model.parameters()), store=NumpyStore()):
                loss = model(**batch).loss
            if step == num_steps - 1:
                _hook_graph(loss.grad_fn, tracker, nodes)
            loss.backward()
            del loss, batch
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return nodes


def _hook_graph(root, tracker, nodes: list) -> None:
    before: dict = {}

    def pre(node):
        before[node] = (tracker.live_bytes, tracker.peak_bytes)
        tracker.reset_peak()

    def post(node):
        live, peak = before.pop(node)
        nodes.append((node.name(), live, tracker.peak_bytes))
        tracker.peak_bytes = max(tracker.peak_bytes, peak)

    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        node.register_prehook(lambda grads, node=node: pre(node))
        node.register_hook(lambda grads_in, grads_out, node=node: post(node))
        stack.extend(fn for fn, _ in node.next_functions)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", required=True, help="an offload row id of tests/golden/cpu_measurements_backward.json")
    parser.add_argument("--top", type=int, default=6)
    args = parser.parse_args(argv)
    rows = {r["id"]: r for r in json.loads(GOLDEN.read_text())["rows"]}
    if args.row not in rows or rows[args.row]["plan"]["offload_activations"] == "none":
        parser.exit(2, f"--row {args.row}: not an offload row of {GOLDEN.name}; pick one of "
                       f"{', '.join(k for k, r in rows.items() if r['plan']['offload_activations'] != 'none')}\n")
    for name, live, peak in sorted(node_peaks(rows[args.row]), key=lambda n: -n[2])[:args.top]:
        print(f"{name:50s} live before {live / 1e6:8.2f} MB  peak while running {peak / 1e6:8.2f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
