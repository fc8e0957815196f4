"""The plan layer (memkit/ARCHITECTURE.md, "Layers"): the knobs of one way to train and the rules
they obey, torch-free. plan.py (`TrainingPlan`, every knob declared once), parallel.py (split rules
and degree checks), techniques.py, backward_techniques.py, quantize.py (which techniques a plan may
combine), limits.py (flag ranges), plan_schema.py (plan.json's format and field checks).

memkit's own modules import the submodule that states a name; `from memkit.plan import
TrainingPlan` (the names memkit/plan/plan.py defines) still works, resolved on first use so that
importing one rule module does not load the others."""


_SUBMODULES = ("plan", "parallel", "techniques", "backward_techniques", "quantize", "limits", "plan_schema")


def __getattr__(name: str):
    import importlib

    if name in _SUBMODULES:  # `from memkit.plan import plan_schema` loads that module only
        return importlib.import_module(f"{__name__}.{name}")
    module = importlib.import_module("memkit.plan.plan")
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module 'memkit.plan' has no attribute {name!r}") from None
