"""Fine-tune a causal LM under a memkit plan: a thin wrapper around memkit.finetune, kept for
checkouts. From any directory (and with a pip-installed memkit) use the module instead:

    accelerate launch --config_file runs/x/accelerate.yaml -m memkit.finetune \
        --plan runs/x/plan.json --data train.jsonl --output-dir out/ --max-steps 200

`python launch/finetune.py --help` lists every flag. The loop lives in memkit.train.
"""
import sys

from memkit.train.main import main

if __name__ == "__main__":
    sys.exit(main())
