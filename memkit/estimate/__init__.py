"""Estimators: memory.py (per-component, per-phase peak), activations.py, throughput.py."""

import sys as _sys
import types as _types


class _CallableModule(_types.ModuleType):
    """`memkit.estimate(...)` is the public API function (estimate/entry.py, re-exported by
    memkit/api.py), while `memkit.estimate.memory` etc. stay the estimator modules (a package cannot be a function;
    a module's __class__ may be a ModuleType subclass: Python docs, "Customizing module attribute
    access", 3.5+)."""

    def __call__(self, *args, **kwargs):
        from memkit.estimate.entry import estimate

        return estimate(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallableModule
