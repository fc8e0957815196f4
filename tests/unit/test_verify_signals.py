"""`memkit verify` relays SIGUSR1 as it relays SIGTERM (#28): its launcher (a real torchrun) handles
the signal and passes it to both ranks (torchrun's log says so: "Received ... SIGUSR1 death signal,
shutting down workers", torch/distributed/elastic/agent/server/api.py), instead of dying of it
(SIGUSR1's default action) and leaving the ranks to be found as orphans; verify exits 138."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from torchrun_stub import wait_until_ready  # tests/unit/torchrun_stub.py

RANK = """
import os, signal, sys, time, pathlib
out = pathlib.Path(sys.argv[1]); rank = os.environ["RANK"]
def stop(signum, frame):
    (out / f"stopped.{rank}").write_text(str(signum))
    sys.exit(128 + signum)
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
    signal.signal(sig, stop)
(out / f"ready.{rank}").write_text(str(os.getpid()))
while True:
    time.sleep(0.05)
"""
DRIVER = """
import sys
from pathlib import Path
from memkit.cli.verify import _run
status, code = _run(sys.argv[2:], Path(sys.argv[1]), timeout_s=300)
print(status, code, flush=True)
sys.exit(code)
"""


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_verify_relays_the_signal_through_its_launcher(tmp_path, sig):
    (tmp_path / "rank.py").write_text(RANK)
    log = tmp_path / "launch.log"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0",
                str(tmp_path / "rank.py"), str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_SIGNALS_TO_HANDLE", "PET_SIGNALS_TO_HANDLE",
                                                             "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(log), *torchrun], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        wait_until_ready(tmp_path, driver)
        driver.send_signal(sig)
        out, _ = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 128 + int(sig) and out.split() == ["signal", str(128 + int(sig))]
    assert [(tmp_path / f"stopped.{r}").read_text() for r in (0, 1)] == [str(int(sig))] * 2
    # the launcher relayed it (a launcher dead of SIGUSR1 logs nothing; the ranks then get it as orphans)
    assert f"Received {signal.Signals(sig)!s} death signal, shutting down workers" in log.read_text(), \
        log.read_text()[-2000:]
