"""memkit: predict, plan and emit memory-fitting training configs for Hugging Face models.

Python API (memkit/api.py; imported on first use, so `import memkit` stays instant):

    memkit.estimate(model, gpu=..., **plan_knobs)   -> MemoryEstimate   (memkit estimate)
    memkit.suggest(model, gpu=..., global_batch_size=..., seq_len=...) -> SearchResult (memkit suggest)
    memkit.training_arguments(plan or plan.json, output_dir=...) -> transformers TrainingArguments
    memkit.MemkitCallback(path, prediction=...)     HF TrainerCallback: measured vs predicted

`memkit.estimate` is also the estimator package (memkit/estimate/); calling it calls
memkit.api.estimate (memkit/estimate/entry.py; see memkit/estimate/__init__.py).
"""

__version__ = "0.1.0"

_LAZY = {"suggest": "memkit.api", "model_spec": "memkit.api", "training_arguments": "memkit.api",
         "MemkitCallback": "memkit.callback"}
__all__ = ["estimate", "suggest", "model_spec", "training_arguments", "MemkitCallback", "__version__"]


def __getattr__(name: str):
    import importlib

    if name == "estimate":  # the subpackage; it is callable
        return importlib.import_module("memkit.estimate")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'memkit' has no attribute {name!r}")
