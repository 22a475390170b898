"""Small filesystem helpers: atomic writes, hashing, safe keys. Used by every cache bucket."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

CHUNK = 1 << 20
_SAFE = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def safe_key(text: str) -> str:
    """Encode any string as one path component: safe characters pass, others become %XX."""
    out = []
    for ch in text:
        if ch in _SAFE:
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8"))
    key = "".join(out)
    # '.' and '..' are not names; a leading dot would hide the entry.
    return "%2E" + key[1:] if key.startswith(".") else key


def unsafe_key(key: str) -> str:
    """Invert `safe_key`."""
    from urllib.parse import unquote

    return unquote(key)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def make_dirs(path: Path) -> None:
    """`mkdir -p` whose new folders are 0755 whatever the umask: a group-writable folder would
    let others rewrite the cache, and the loader refuses such a cache (see safety.py)."""
    missing = []
    probe = Path(path)
    while not probe.is_dir():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o755)
        except FileExistsError:
            if not folder.is_dir():
                raise


def atomic_write_bytes(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Write `data` to `path` so a reader sees the old file or the new one, never a part.

    No fsync: a killed process can never leave a partial file (rename is atomic), and after a
    power loss a torn file is caught by verification (objects, trees) or read as absent (records).
    """
    make_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj: object) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode("utf-8") + b"\n")


def read_json(path: Path) -> object | None:
    """The parsed JSON at `path`, or None when it is missing or unreadable (treated as absent)."""
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def is_writable_dir(path: Path) -> bool:
    try:
        make_dirs(path)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)
