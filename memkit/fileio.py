"""Reading the user's files in one place: every OS and decoding error becomes one MemkitError line.

config.json, plan.json, accelerate.yaml, hostfiles and data files all come through here, so a
missing file, a folder where a file was expected, a permission error, a binary or UTF-16 file
and broken JSON are each reported as "WHAT PATH: what is wrong; how to fix it" (exit code 2)
instead of a PermissionError / UnicodeDecodeError traceback.
"""
from __future__ import annotations

import codecs
import json
import math
import os
from pathlib import Path

from memkit.errors import MemkitError

MAX_CONFIG_BYTES = 64 * 1024**2
"""Largest config/plan/hostfile read whole (a plan.json is ~20 KB; a config.json a few KB)."""
_UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE, codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)
_CHUNK = 1 << 20


def _label(what: str, path) -> str:
    return f"{what} {path}" if what else str(path)


def _os_error(what: str, path, exc: OSError) -> MemkitError:
    reason = exc.strerror or type(exc).__name__
    return MemkitError(f"{_label(what, path)}: cannot read it ({reason}); check the path and its permissions")


def check_file(path, *, what: str = "", fix: str = "") -> Path:
    """The path, if it names an existing regular file we may open; else one line."""
    p = Path(path)
    hint = f"; {fix}" if fix else ""
    try:
        if not p.exists():
            raise MemkitError(f"{_label(what, path)}: no such file{hint}")
        if p.is_dir():
            raise MemkitError(f"{_label(what, path)} is a folder, not a file{hint}")
        kind = special_kind(p)
        if kind:  # opening a FIFO blocks until a writer comes; a device never ends
            raise MemkitError(f"{_label(what, path)} is a {kind}, not a regular file{hint}")
    except OSError as exc:  # e.g. a path component that is not a folder, a name too long
        raise _os_error(what, path, exc) from None
    return p


def special_kind(path) -> str:
    """'' for a regular file (or a link to one); else what it is: a FIFO, a device or a socket
    (stat(2) file types, Python's stat module)."""
    import stat

    mode = os.stat(path).st_mode
    for test, name in ((stat.S_ISFIFO, "FIFO (named pipe)"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return ""


def _looks_utf16(head: bytes) -> bool:
    """A BOM, or ASCII-range UTF-16 without one: every other byte zero, the bytes between not."""
    if head.startswith(_UTF16_BOMS):
        return True
    sample = head[:512] if len(head) % 2 == 0 else head[:511]
    if len(sample) < 4:
        return False
    low, high = sample[0::2], sample[1::2]
    return (not any(high) and all(low)) or (not any(low) and all(high))


def sniff(head: bytes, *, what: str, path) -> None:
    """UTF-16/32 or binary (NUL bytes) from the first bytes of a file: one line each."""
    if _looks_utf16(head):
        raise MemkitError(f"{_label(what, path)} is UTF-16/UTF-32 text; save it as UTF-8")
    if b"\x00" in head:
        raise MemkitError(f"{_label(what, path)} is a binary file (it contains NUL bytes), not text")


def decode_text(data: bytes, *, what: str, path) -> str:
    """UTF-8 text (an optional UTF-8 BOM is dropped); UTF-16/32, binary and bad UTF-8 are errors."""
    sniff(data, what=what, path=path)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise MemkitError(f"{_label(what, path)} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                          f"{exc.start}); save it as UTF-8") from None


def read_text(path, *, what: str = "", fix: str = "", max_bytes: int = MAX_CONFIG_BYTES) -> str:
    """The whole file as UTF-8 text, or one MemkitError line."""
    p = check_file(path, what=what, fix=fix)
    try:
        with open(p, "rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as exc:
        raise _os_error(what, path, exc) from None
    if len(data) > max_bytes:
        raise MemkitError(f"{_label(what, path)} is larger than {max_bytes // 1024**2} MiB; is it the right file?")
    return decode_text(data, what=what, path=path)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_json(text: str, *, what: str = "", path="") -> object:
    """json.loads that rejects NaN/Infinity (not JSON, RFC 8259 Sec. 6) and says where it broke."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise MemkitError(f"{_label(what, path)} is not valid JSON: {exc.msg} at line {exc.lineno}, column "
                          f"{exc.colno}; fix the file or write it again") from None
    except ValueError as exc:  # _reject_constant, or a number too long to convert
        raise MemkitError(f"{_label(what, path)} is not valid JSON ({exc}); fix the file or write it again") from None
    except RecursionError:
        raise MemkitError(f"{_label(what, path)} is nested too deeply to be a memkit/HF file") from None


def read_json(path, *, what: str = "", fix: str = "") -> object:
    return parse_json(read_text(path, what=what, fix=fix), what=what, path=path)


def read_json_object(path, *, what: str = "", fix: str = "", noun: str = "JSON object") -> dict:
    """A file holding one JSON object (a config.json, a plan.json)."""
    data = read_json(path, what=what, fix=fix)
    if not isinstance(data, dict):
        raise MemkitError(f"{_label(what, path)} holds a JSON {type(data).__name__}, not a {noun}"
                          + (f"; {fix}" if fix else ""))
    return data


def check_text_file(path, *, what: str = "", fix: str = "") -> Path:
    """Stream a (possibly large) text file once: exists, readable, UTF-8. Reads 1 MiB at a time."""
    p = check_file(path, what=what, fix=fix)
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    try:
        with open(p, "rb") as handle:
            while True:
                chunk = handle.read(_CHUNK)
                if offset == 0:
                    sniff(chunk[:4096], what=what, path=path)
                if not chunk:
                    decoder.decode(b"", final=True)
                    break
                if b"\x00" in chunk:
                    raise MemkitError(f"{_label(what, path)} is a binary file (it contains NUL bytes), not text")
                decoder.decode(chunk)
                offset += len(chunk)
    except OSError as exc:
        raise _os_error(what, path, exc) from None
    except UnicodeDecodeError as exc:
        raise MemkitError(f"{_label(what, path)} is not UTF-8 text (near byte offset {offset + exc.start}); "
                          "save it as UTF-8") from None
    return p


def finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def temp_beside(path) -> Path:
    """A hidden temporary name in `path`'s folder with the same suffix (matplotlib infers the format
    from it): write there, then os.replace onto `path`, so a failure never leaves half a file."""
    p = Path(path)
    return p.with_name(f".{p.stem}.memkit-tmp-{os.getpid()}{p.suffix}")


def write_text_atomic(path, text: str, *, what: str) -> Path:
    """Write `text` to `path` whole or not at all: into a hidden temporary file beside it
    (temp_beside), flushed and fsynced, then os.replace (atomic; POSIX.1-2017 rename). A full or
    read-only disk, a quota or a file-size limit is one MemkitError line (exit 2), the temporary
    file is removed and `path` keeps what it had."""
    p = Path(path)
    tmp = temp_beside(p)
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, p)
    except OSError as exc:
        raise MemkitError(f"could not write {what} {p}: {(exc.strerror or str(exc)).lower()}; free space or pick "
                          "a writable path") from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    return p
