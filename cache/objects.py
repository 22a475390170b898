"""The object store: file contents addressed by sha256, each stored once.

Objects are read-only files at `objects/<aa>/<rest-of-sha256>`. They enter only through an
`ObjectWriter`, which hashes while bytes arrive and renames into place only when the digest is
the one expected, so a crash or a bad download never leaves a wrong object under a good name.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

from .fsutil import atomic_write_bytes, make_dirs, sha256_file
from .staging import Staging


class DigestMismatch(ValueError):
    """Bytes written to an ObjectWriter do not have the digest the caller expected."""


class ObjectStore:
    """Objects by sha256, plus aliases: other digests of the same bytes (e.g. a git blob id)
    that let a caller find an object it knows only by that other name."""

    def __init__(self, root: Path, staging: Staging, aliases: Path | None = None):
        self.root = root
        self.staging = staging
        self.aliases = aliases if aliases is not None else root.parent / "aliases"

    def alias_get(self, algorithm: str, digest: str) -> str | None:
        """The sha256 of the object known as `algorithm:digest`, if recorded and present."""
        try:
            sha256 = (self.aliases / algorithm / digest).read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
        return sha256 if len(sha256) == 64 and self.has(sha256) else None

    def alias_put(self, algorithm: str, digest: str, sha256: str) -> None:
        atomic_write_bytes(self.aliases / algorithm / digest, sha256.encode())

    def path(self, sha256: str) -> Path:
        return self.root / sha256[:2] / sha256[2:]

    def has(self, sha256: str, size: int | None = None) -> bool:
        try:
            st = self.path(sha256).stat()
        except OSError:
            return False
        return size is None or st.st_size == size

    def verify(self, sha256: str) -> bool:
        """Full re-hash of one object."""
        try:
            return sha256_file(self.path(sha256)) == sha256
        except OSError:
            return False

    def remove(self, sha256: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(sha256))

    def writer(self) -> ObjectWriter:
        return ObjectWriter(self)

    def ingest_bytes(self, data: bytes, expected_sha256: str | None = None) -> str:
        with self.writer() as w:
            w.write(data)
            return w.commit(expected_sha256)

    def iter_digests(self):
        if not self.root.is_dir():
            return
        for shard in sorted(self.root.iterdir()):
            if len(shard.name) == 2 and shard.is_dir():
                for obj in shard.iterdir():
                    if len(obj.name) == 62:
                        yield shard.name + obj.name


class ObjectWriter:
    """Streams bytes into a temp file; `commit()` checks the digest and publishes the object."""

    def __init__(self, store: ObjectStore):
        self.store = store
        fd, name = tempfile.mkstemp(prefix="obj-", dir=store.staging.folder())
        self._fh = os.fdopen(fd, "wb")
        self._tmp = Path(name)
        self._hash = hashlib.sha256()
        self.size = 0
        self._done = False

    def write(self, chunk: bytes) -> None:
        self._fh.write(chunk)
        self._hash.update(chunk)
        self.size += len(chunk)

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def commit(self, expected_sha256: str | None = None) -> str:
        """Publish the object; returns its sha256. Raises DigestMismatch and keeps nothing."""
        digest = self.sha256
        if expected_sha256 is not None and digest != expected_sha256:
            self.abort()
            raise DigestMismatch(f"expected sha256 {expected_sha256}, got {digest}")
        self._fh.close()
        os.chmod(self._tmp, 0o444)
        dest = self.store.path(digest)
        make_dirs(dest.parent)
        if dest.exists() and dest.stat().st_size == self.size:
            # Same content already stored (another process, another repo): keep that one.
            self._tmp.unlink()
        else:
            os.replace(self._tmp, dest)
        self._done = True
        return digest

    def abort(self) -> None:
        if not self._done:
            with contextlib.suppress(OSError):
                self._fh.close()
            with contextlib.suppress(OSError):
                self._tmp.unlink()
            self._done = True

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.abort()
