"""Byte units. The one place that owns 1024**3 (memkit/ARCHITECTURE.md, "Conventions")."""
from __future__ import annotations

import re

from memkit.errors import MemkitError

KIB = 1024
MIB = 1024**2
GIB = 1024**3
TIB = 1024**4

_SUFFIX = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": KIB,
    "m": 1000**2, "mb": 1000**2, "mib": MIB,
    "g": GIB, "gb": 1000**3, "gib": GIB,
    "t": TIB, "tb": 1000**4, "tib": TIB,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, *, what: str = "size") -> int:
    """'24GiB' -> 25769803776. A bare 'G' means GiB (what nvidia-smi users mean); 'GB' is 10**9."""
    match = _BYTES_RE.match(str(text))
    if not match or match.group(2).lower() not in _SUFFIX:
        raise MemkitError(f"{what} {text!r} is not a size; write e.g. 24GiB, 80GB or 16384MiB")
    value = float(match.group(1)) * _SUFFIX[match.group(2).lower()]
    if value <= 0:
        raise MemkitError(f"{what} {text!r} must be positive")
    return int(value)


def gib(num_bytes: float) -> float:
    return num_bytes / GIB


def format_bytes(num_bytes: float) -> str:
    """Human form in binary units, e.g. '27.10 GiB'."""
    value = float(num_bytes)
    for unit, size in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{int(value)} B"
