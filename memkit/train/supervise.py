"""Run a launcher (accelerate launch -> torchrun -> ranks) as a child and own its lifetime.

SIGTERM / SIGINT to memkit go to the launcher's process group once; torchrun relays the same
signal to each rank (torch/distributed/elastic/agent/server/api.py: SignalException ->
_shutdown(e.sigval)), and each rank checkpoints at its next step boundary and exits 143 / 130
(memkit.train.loop.StopFlag). The ranks are not in the launcher's group: torchrun starts each
in its own session (torch/distributed/elastic/multiprocessing/subprocess_handler/
subprocess_handler.py, start_new_session=True), so killpg alone never reaches them. The process
tree is therefore snapshotted from /proc before anything is signalled, and whatever of it is
still alive after the grace period (or orphaned by a launcher that died first) is signalled by
PID. memkit then exits 128 + signal number (143 for SIGTERM, 130 for SIGINT, 138 for SIGUSR1)
itself.

A scheduler signals every process at once (Slurm's scancel, a pod kill), so memkit may get the
same signal twice (from the scheduler and from whoever started it); a repeat within the grace
period is ignored, as the ranks ignore theirs (memkit.train.loop.StopFlag), and only one later
than that stops the tree now. SIGUSR1 (checkpoint-and-exit) reaches the ranks only if the
launcher relays it instead of dying of it (SIGUSR1's default action): launcher_env() adds it to
the signals torchrun handles. PContext.start (torch/distributed/elastic/multiprocessing/api.py)
reads TORCHELASTIC_SIGNALS_TO_HANDLE, but since torchrun grew --signals-to-handle the launcher
overwrites that variable with the flag's value (torch/distributed/launcher/api.py, launch_agent:
os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle), whose default comes from
PET_SIGNALS_TO_HANDLE (torch/distributed/run.py, get_args_parser: action=env reads PET_<DEST>;
`accelerate launch` builds its torchrun arguments from that parser, accelerate/commands/launch.py
_filter_args). Both are set: measured on torch 2.13, TORCHELASTIC_SIGNALS_TO_HANDLE alone left
torchrun dying of SIGUSR1 (tests/unit/test_verify_signals.py).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

EXIT_SIGNAL = {sig: 128 + int(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
"""The shell's 128 + signal number (memkit.train.loop.EXIT_SIGNAL, the ranks' own codes)."""
POLL_S = 0.2
TORCHELASTIC_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
"""torchrun's default list (torch/distributed/elastic/multiprocessing/api.py, PContext.start) + SIGUSR1."""
SHUTDOWN_MARGIN_S = 10.0
"""Past --preempt-grace: the launcher and memkit wait this much longer before SIGKILL."""


def launcher_env(env: dict, *, preempt_grace_s: float) -> dict:
    """`env` for a torchrun-based launcher: it relays SIGUSR1 too, and waits for the ranks' save
    (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, torch/distributed/launcher/api.py, LaunchConfig) at least
    the grace plus a margin before its SIGKILL. Values the user set are kept."""
    out = dict(env)
    out.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", TORCHELASTIC_SIGNALS)  # torch before --signals-to-handle
    out.setdefault("PET_SIGNALS_TO_HANDLE", out["TORCHELASTIC_SIGNALS_TO_HANDLE"])  # torchrun's flag (module doc)
    out.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(preempt_grace_s + SHUTDOWN_MARGIN_S)))
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc/<pid>/stat parent links; [] where /proc is absent)."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # /proc/<pid>/stat: "pid (comm) state ppid ..."; comm may hold spaces, so split after ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _signal(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Supervisor:
    """Popen `cmd` in a new session; wait for it; on SIGTERM/SIGINT stop the whole tree."""

    def __init__(self, cmd: list[str], *, env: dict, stdout=None, grace_s: float = 60.0,
                 stderr_reader=None) -> None:
        """stderr_reader: called with the child's stderr (a pipe) in a thread of its own; the
        thread is joined before run() returns (memkit.cli.train turns a worker's error into one line)."""
        self.cmd, self.env, self.stdout, self.grace_s = cmd, env, stdout, grace_s
        self.stderr_reader = stderr_reader
        self.signum: int | None = None
        self.signalled_at: float | None = None
        self.proc: subprocess.Popen | None = None

    def run(self, *, timeout_s: float | None = None) -> tuple[str, int | None]:
        """('ok' | 'failed' | 'timeout' | 'signal', exit code to report)."""
        old = {sig: signal.signal(sig, self._on_signal) for sig in EXIT_SIGNAL}
        try:
            stderr = subprocess.PIPE if self.stderr_reader is not None else (
                subprocess.STDOUT if self.stdout is not None else None)
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self.stdout, stderr=stderr,
                                         start_new_session=True)
            if self.stderr_reader is not None:
                import threading

                reader = threading.Thread(target=self.stderr_reader, args=(self.proc.stderr,), daemon=True)
                reader.start()
                self._reader = reader
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while self.proc.poll() is None and self.signum is None:
                if deadline is not None and time.monotonic() > deadline:
                    self.stop(signal.SIGTERM, grace_s=min(self.grace_s, 30.0))
                    return "timeout", None
                time.sleep(POLL_S)
            if self.signum is not None:
                self.stop(self.signum, grace_s=self.grace_s)
                return "signal", EXIT_SIGNAL[self.signum]
            code = self.proc.returncode
            return ("ok" if code == 0 else "failed"), code
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            reader = getattr(self, "_reader", None)
            if reader is not None:
                reader.join(timeout=30)  # the pipe closes when the last process holding it exits

    def _on_signal(self, signum, frame) -> None:
        if self.signum is not None:
            late = time.monotonic() - self.signalled_at > self.grace_s
            if late and self.proc is not None:  # a repeat past the grace: stop now
                self._kill_tree(descendants(self.proc.pid))
            return  # a repeat within the grace (the scheduler's copy of the same stop): ignored
        self.signum, self.signalled_at = signum, time.monotonic()

    def stop(self, sig: int, *, grace_s: float) -> None:
        """`sig` to the launcher's group once; the ranks of a dead launcher by PID; SIGKILL the rest
        after grace_s."""
        proc = self.proc
        tree = descendants(proc.pid)
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        orphans_signalled = False
        while time.monotonic() < deadline:
            launcher_done = proc.poll() is not None
            alive = [pid for pid in tree if _alive(pid)]
            if launcher_done and not alive:
                return
            if launcher_done and not orphans_signalled:  # nobody relays the signal to them any more
                _signal(alive, sig)
                orphans_signalled = True
            time.sleep(POLL_S)
        self._kill_tree(tree)

    def _kill_tree(self, tree: list[int]) -> None:
        proc = self.proc
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _signal([pid for pid in tree + descendants(proc.pid) if _alive(pid)], signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
