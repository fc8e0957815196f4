"""The runner as an installed module: `accelerate launch -m memkit.finetune ...` from any directory.

    accelerate launch --config_file runs/x/accelerate.yaml -m memkit.finetune \\
        --plan runs/x/plan.json --data train.jsonl --output-dir out/ --max-steps 200

(`-m` is accelerate launch's --module flag: each process runs this module as `python -m` would.)
`python -m memkit.finetune --help` lists every flag; the `memkit-finetune` console script is the
same program. launch/finetune.py in a checkout is a thin wrapper around the same main.
"""
import sys

from memkit.train.main import main

if __name__ == "__main__":
    sys.exit(main())
