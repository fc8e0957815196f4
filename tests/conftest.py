"""Session setup shared by tests/unit and tests/e2e."""
from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker reads the xdist_group marks (xdist/remote.py)
def pytest_collection_modifyitems(config, items):
    """Every e2e test (a real multi-process run) is also `slow`: `pytest -m "not slow"` is the
    inner loop, the full suite (.ci/run) runs everything.

    Each file is one xdist_group (pyproject: --dist loadgroup), so a file's tests run on one
    worker and its module-scoped fixtures (one launched run shared by the assertions that read
    it) run once, as under --dist loadfile. A file whose tests share nothing but warm caches
    defines WORKER_GROUP(item) -> str instead: its tests are grouped by that name, so both workers
    share the file while the tests that reuse each other's work (the replay memo of
    estimate/memory.py, say) stay in one process."""
    for item in items:
        if item.get_closest_marker("e2e") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        file = item.nodeid.split("::")[0]
        grouping = getattr(getattr(item, "module", None), "WORKER_GROUP", None)
        item.add_marker(pytest.mark.xdist_group(f"{file}::{grouping(item)}" if grouping else file))


class _LongFilesFirst:
    """Files with e2e tests first, then files with other `slow` tests, then the rest; each file's
    tests stay together and in their order. pyproject's addopts pass --no-loadscope-reorder, so
    pytest-xdist hands the groups out in this order (its default orders them by test count, which
    puts the e2e files, a few tests of 20-60 s launches each, last:
    xdist/scheduler/loadscope.py, LoadScopeScheduling.schedule): the launches start at once on
    both workers and the many short unit files fill the end, so neither worker idles while the
    other finishes one long file."""

    @pytest.hookimpl(trylast=True)  # after the markers above and -m / -k deselection
    def pytest_collection_modifyitems(self, items):
        rank: dict[str, int] = {}
        for item in items:
            here = 0 if item.get_closest_marker("e2e") else 1 if item.get_closest_marker("slow") else 2
            rank[item.nodeid.split("::")[0]] = min(here, rank.get(item.nodeid.split("::")[0], 2))
        items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])  # stable: file order kept within a rank


def pytest_configure(config):
    config.pluginmanager.register(_LongFilesFirst(), "memkit-long-files-first")


@pytest.fixture(scope="session", autouse=True)
def deepspeed_cpu_ops(request):
    """Build DeepSpeed's CPU ops once, before the first e2e test, outside every timed launch
    (tests/prebuild_ops.py); launch timeouts are then hang guards, not build-time margins.
    Under pytest-xdist every worker runs this fixture: a file lock lets the first build and the
    others wait, then find the ops in the torch-extensions cache."""
    if any(item.get_closest_marker("e2e") for item in request.session.items):
        from filelock import FileLock

        from prebuild_ops import prebuild

        with FileLock(str(Path(tempfile.gettempdir()) / "memkit-tests-prebuild-ops.lock")):
            prebuild()
    yield


CPU_REPORT = os.environ.get("MEMKIT_TEST_CPU_REPORT")
"""A file that gets one JSON line per test: its CPU seconds, this process's plus its finished
child processes' (getrusage RUSAGE_SELF + RUSAGE_CHILDREN: a launch's launcher and ranks once
waited for), setup and teardown included. CPU seconds, unlike --durations' wall seconds, do not
depend on what else the machine runs; the suite's wall time on CI's 2 idle cores is about their
sum over 2. Off unless the variable is set."""


def _cpu_s() -> float:
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not CPU_REPORT:
        yield
        return
    before = _cpu_s()
    yield
    with open(CPU_REPORT, "a") as handle:
        name = item.nodeid.removesuffix("@" + item.nodeid.split("::")[0])  # less the xdist_group suffix
        handle.write(json.dumps({"test": name, "cpu_s": round(_cpu_s() - before, 2)}) + "\n")
