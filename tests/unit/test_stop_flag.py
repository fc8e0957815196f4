"""memkit.train.loop.StopFlag (#28): repeats of a stop signal within --preempt-grace only re-set
the flag (the scheduler's copy and the launcher's relay reach a rank one after the other); a
repeat after the grace gets the default action. Run in a child process that signals itself."""
from __future__ import annotations

import signal
import subprocess
import sys

CHILD = """
import os, signal, sys, time
from memkit.train.loop import StopFlag
stop = StopFlag(float(sys.argv[1])).install()
for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
    os.kill(os.getpid(), sig)
print(stop.signum, stop.flags(), flush=True)
time.sleep(float(sys.argv[1]) + 0.2)
os.kill(os.getpid(), signal.SIGTERM)
print("alive", flush=True)
"""


def test_repeats_within_the_grace_are_ignored_and_a_late_one_kills():
    proc = subprocess.run([sys.executable, "-c", CHILD, "0.5"], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines() == [f"{int(signal.SIGTERM)} [1.0, 0.0, 0.0]"]  # SIGTERM, SIGINT, SIGUSR1
    assert proc.returncode == -signal.SIGTERM  # the late repeat: the default action


def test_the_first_signal_decides_the_stop():
    """SIGUSR1, then torchrun's shutdown SIGTERM within the grace: the stop stays SIGUSR1's (exit 138)."""
    child = CHILD.replace("(signal.SIGTERM, signal.SIGTERM, signal.SIGINT, signal.SIGTERM)",
                          "(signal.SIGUSR1, signal.SIGTERM, signal.SIGUSR1)")
    proc = subprocess.run([sys.executable, "-c", child, "0.5"], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines()[0] == f"{int(signal.SIGUSR1)} [0.0, 0.0, 1.0]"


def test_exit_codes_are_128_plus_the_signal():
    from memkit.train.loop import EXIT_SIGNAL, STOP_SIGNALS

    assert STOP_SIGNALS == (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    assert [EXIT_SIGNAL[s] for s in STOP_SIGNALS] == [143, 130, 138]
