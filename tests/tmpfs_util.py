"""A real small file system for tests of full / read-only checkpoint folders: a tmpfs mounted at
a folder (needs root for mount(8); the test is skipped where it cannot mount)."""
from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(mount_point: Path, size: str):
    """Mount a tmpfs of `size` (mount(8) syntax, e.g. "3m") at `mount_point` for the block."""
    mount_point.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def remount_read_only(mount_point: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mount_point)], check=True)
