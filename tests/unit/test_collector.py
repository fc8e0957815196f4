"""memkit/train/collector.py: the garbage collector paused through a run's set-up, on for its steps,
and the caller's collector as it was once an in-process run returns."""
from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import pytest

from memkit.train import collector

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from runner_util import write_tiny_llama  # noqa: E402


class _Node:
    pass


def _cycle() -> weakref.ref:
    """A two-object reference cycle that nothing else holds: only the cyclic collector frees it."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def collector_on():
    """Tests start and end with the collector on and nothing frozen, as pytest runs them."""
    assert gc.isenabled() and not gc.get_freeze_count()
    yield
    collector.restore()
    gc.unfreeze()
    gc.enable()


def test_setup_cycles_are_freed_and_the_survivors_frozen(collector_on):
    collector.pause()
    assert not gc.isenabled()
    garbage = _cycle()
    kept = _Node()
    kept.me = kept  # a cycle still referenced: it survives and is frozen
    churn = [[] for _ in range(10 * gc.get_threshold()[0])]  # enough new containers to trigger a collection
    assert garbage() is not None  # none ran: paused
    collector.resume()
    assert gc.isenabled() and gc.get_freeze_count() > 0
    assert garbage() is None and kept.me is kept and churn
    collector.restore()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_caller_with_the_collector_off_keeps_it_off(collector_on):
    gc.disable()
    collector.pause()
    collector.resume()
    assert not gc.isenabled() and gc.get_freeze_count() == 0
    collector.restore()
    assert not gc.isenabled()


def _frozen(obj) -> bool:
    """In the permanent generation: gc.get_objects() lists the three collected generations only
    (CPython Modules/gcmodule.c gc_get_objects_impl), so a tracked object it omits is frozen. (The
    freeze count is no witness: it drops whenever any frozen object is freed, e.g. by another thread.)"""
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


def test_a_caller_that_froze_objects_keeps_them_frozen(collector_on):
    theirs = _Node()
    theirs.me = theirs
    gc.freeze()
    assert _frozen(theirs)
    collector.pause()
    collector.resume()
    assert gc.isenabled() and _frozen(theirs)
    collector.restore()
    assert _frozen(theirs)


def test_an_in_process_run_steps_with_the_collector_on_and_returns_it_as_it_was(collector_on, tmp_path,
                                                                               monkeypatch, capfd):
    from memkit.train import loop
    from memkit.train.main import run_finetune

    seen = {}
    steps = loop._steps

    def observed(state):  # the loop's own step function, with the collector's state noted first
        seen.update(enabled=gc.isenabled(), frozen=gc.get_freeze_count())
        return steps(state)

    monkeypatch.setattr(loop, "_steps", observed)
    model = write_tiny_llama(tmp_path / "tiny").parent
    code = run_finetune(["--model", str(model), "--data", "synthetic:8", "--output-dir", str(tmp_path / "out"),
                         "--seq-len", "16", "--max-steps", "1", "--no-progress"])
    assert code == 0, capfd.readouterr().err[-2000:]
    assert seen["enabled"] and seen["frozen"] > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0


@pytest.mark.parametrize("bad", [False, True])
def test_an_in_process_run_gives_the_callers_signal_handlers_back(collector_on, tmp_path, capfd, bad):
    """Refused before its first step or trained to the end: Ctrl-C raises KeyboardInterrupt again
    afterwards, the collector is on."""
    import signal

    from memkit.train.main import run_finetune

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    model = write_tiny_llama(tmp_path / "tiny").parent
    data = str(tmp_path / "missing.jsonl") if bad else "synthetic:8"
    code = run_finetune(["--model", str(model), "--data", data, "--output-dir", str(tmp_path / "out"),
                         "--seq-len", "16", "--max-steps", "1", "--no-progress"])
    assert code == (2 if bad else 0), capfd.readouterr().err[-2000:]
    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert gc.isenabled() and gc.get_freeze_count() == 0
