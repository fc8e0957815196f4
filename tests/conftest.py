"""Session setup shared by tests/unit and tests/e2e."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session", autouse=True)
def deepspeed_cpu_ops(request):
    """Build DeepSpeed's CPU ops once, before the first e2e test, outside every timed launch
    (tests/prebuild_ops.py); launch timeouts are then hang guards, not build-time margins."""
    if any(item.get_closest_marker("e2e") for item in request.session.items):
        from prebuild_ops import prebuild

        prebuild()
    yield
