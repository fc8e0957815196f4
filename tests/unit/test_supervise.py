"""SIGTERM / SIGINT to memkit reach every rank of a torchrun launch (ranks run in their own
sessions), a rank that ignores it is killed after the grace period, and memkit exits 143 / 130."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchrun_stub import wait_until_ready  # tests/unit/torchrun_stub.py

RANK = """
import os, signal, sys, time, pathlib
out = pathlib.Path(sys.argv[1]); rank = os.environ["RANK"]
def stop(signum, frame):
    (out / f"stopped.{rank}").write_text(str(signum))
    sys.exit(128 + signum)
for sig in (signal.SIGTERM, signal.SIGINT):
    if rank == "1" and len(sys.argv) > 2:
        signal.signal(sig, signal.SIG_IGN)  # a rank stuck in a collective, say
    else:
        signal.signal(sig, stop)
(out / f"ready.{rank}").write_text(str(os.getpid()))
while True:
    time.sleep(0.05)
"""
DRIVER = """
import os, sys
from memkit.train.supervise import Supervisor
status, code = Supervisor(sys.argv[2:], env=dict(os.environ), grace_s=float(sys.argv[1])).run()
print(status, code, flush=True)
sys.exit(code)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("sig, code, stuck", [(signal.SIGTERM, 143, False), (signal.SIGINT, 130, True)])
def test_signal_reaches_every_rank_and_exit_code(tmp_path, sig, code, stuck):
    (tmp_path / "rank.py").write_text(RANK)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0",
                str(tmp_path / "rank.py"), str(tmp_path), *(["stuck"] if stuck else [])]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, "4", *torchrun], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        pids = wait_until_ready(tmp_path, driver)
        assert all(os.getsid(pid) == pid for pid in pids)  # torchrun ranks: each its own session
        driver.send_signal(sig)
        out, _ = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == code and out.split() == ["signal", str(code)]
    assert (tmp_path / "stopped.0").read_text() == str(int(sig))  # torchrun relays the signal
    if stuck:
        assert not (tmp_path / "stopped.1").exists()  # ignored it: killed after the grace period
    else:
        assert (tmp_path / "stopped.1").exists()
    assert not any(_alive(pid) for pid in pids)


SAVING_RANK = """
import os, signal, sys, time, pathlib
out = pathlib.Path(sys.argv[1]); rank = os.environ["RANK"]
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))  # idempotent, as memkit.train.loop.StopFlag
(out / f"ready.{rank}").write_text(str(os.getpid()))
while not got:
    time.sleep(0.05)
time.sleep(2.0)  # "the checkpoint": repeats arriving meanwhile must not get it killed
(out / f"stopped.{rank}").write_text(str(len(got)))
sys.exit(143)
"""


def test_a_repeated_signal_within_the_grace_is_ignored(tmp_path):
    """Slurm's scancel signals memkit and its parent at once: memkit may get SIGTERM twice. The
    repeat within the grace does not SIGKILL the ranks mid-save (#28)."""
    (tmp_path / "rank.py").write_text(SAVING_RANK)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0",
                str(tmp_path / "rank.py"), str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, "30", *torchrun], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        wait_until_ready(tmp_path, driver)
        driver.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        driver.send_signal(signal.SIGTERM)  # the repeat
        out, _ = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 143 and out.split() == ["signal", "143"]
    assert all((tmp_path / f"stopped.{r}").exists() for r in (0, 1))  # both finished their "save"
