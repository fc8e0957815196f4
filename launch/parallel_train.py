"""Train a model built from its config under a plan's tensor/pipeline/data parallel degrees, with
fixed seed and fixed synthetic data, and log per-step loss and per-rank peak live-tensor bytes.

    torchrun --nproc_per_node 2 launch/parallel_train.py --model-config tiny.json --tp 2 --steps 3 \
        --out run.jsonl

A thin entry point: the harness (flags, plan, engines, the JSONL log) is
memkit/calibrate/parallel_step.py.
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from memkit.calibrate.parallel_step import main  # noqa: E402
from memkit.errors import exit_now  # noqa: E402

if __name__ == "__main__":
    exit_now(main())  # the log is written and closed and the ranks past their last barrier by then
