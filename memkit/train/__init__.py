"""The training loop memkit.finetune (launch/finetune.py) runs: data, tokenizer, model, loop, checkpoints.

No planning here: a TrainingPlan arrives decided and the loop honours it (memkit/ARCHITECTURE.md)."""
