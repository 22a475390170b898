"""A variant's metadata.json, parsed and validated (the Hub's kernel metadata schema).

Required: name, id, version, license, backend{type[, archs]}, python-depends. Optional:
kernels-minver, kernel-depends, digest, provenance, upstream, source. Unknown fields are kept
in `raw` and otherwise ignored, as the reference does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import InvalidMetadata

if TYPE_CHECKING:
    from .metadata_extras import KernelDependency, Provenance

_NAME = re.compile(r"^[a-z][-a-z0-9]*[a-z0-9]\Z")
_ID = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_MINVER = re.compile(r"^\d+\.\d+\.\d+\Z")
MAX_METADATA_BYTES = 1 << 20


class KernelName(str):
    """A kernel's `name`: a plain `str` that also has the reference's `python_name`."""

    @property
    def python_name(self) -> str:
        """The name as a Python identifier (dashes become underscores)."""
        return self.replace("-", "_")


# Imported on first use (most kernels have neither kernel-depends nor provenance).
_EXTRAS = ("KernelDependency", "GitStatus", "KernelBuilderVersion", "Provenance")


def __getattr__(name: str):
    if name in _EXTRAS:
        from . import metadata_extras

        return getattr(metadata_extras, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class Metadata:
    name: KernelName
    id: str
    version: int
    license: str
    backend: dict
    python_depends: tuple[str, ...] = ()
    kernels_minver: str | None = None
    kernel_depends: tuple[KernelDependency, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def backend_type(self) -> str:
        return str(self.backend.get("type", ""))

    # Optional fields the reference's Metadata exposes as attributes.
    @property
    def upstream(self) -> str | None:
        value = self.raw.get("upstream")
        return value if isinstance(value, str) else None

    @property
    def source(self) -> str | None:
        value = self.raw.get("source")
        return value if isinstance(value, str) else None

    @property
    def provenance(self) -> Provenance | None:
        raw = self.raw.get("provenance")
        if not isinstance(raw, dict):
            return None  # the common case: no import of metadata_extras
        from .metadata_extras import parse_provenance

        return parse_provenance(raw)

    @classmethod
    def read_from_file(cls, path: str | Path) -> Metadata:
        """The reference's spelling of `read`."""
        return cls.read(Path(path))

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "metadata.json") -> Metadata:
        if len(data) > MAX_METADATA_BYTES:
            raise InvalidMetadata(f"{where}: larger than {MAX_METADATA_BYTES} bytes")
        try:
            raw = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # deep nesting recurses
            raise InvalidMetadata(f"{where}: not valid JSON ({exc})") from None
        return cls.from_dict(raw, where=where)

    @classmethod
    def read(cls, path: Path) -> Metadata:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise InvalidMetadata(f"{path}: metadata.json is missing") from None
        except OSError as exc:
            raise InvalidMetadata(f"{path}: cannot read ({exc.strerror})") from None
        return cls.from_bytes(data, where=str(path))

    @classmethod
    def from_dict(cls, raw: object, *, where: str = "metadata.json") -> Metadata:
        if not isinstance(raw, dict):
            raise InvalidMetadata(f"{where}: expected a JSON object")

        def need(key: str, kind: type | tuple[type, ...]):
            if key not in raw:
                raise InvalidMetadata(f"{where}: required field {key!r} is missing")
            value = raw[key]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                names = (
                    kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
                )
                raise InvalidMetadata(f"{where}: field {key!r} must be {names}, got {value!r}")
            return value

        name = need("name", str)
        if not _NAME.match(name):
            raise InvalidMetadata(f"{where}: name {name!r} must match {_NAME.pattern}")
        ident = need("id", str)
        if not _ID.match(ident):
            raise InvalidMetadata(f"{where}: id {ident!r} must be a Python identifier")
        version = need("version", int)
        license_ = need("license", str)
        backend = need("backend", dict)
        if not isinstance(backend.get("type"), str) or not backend["type"]:
            raise InvalidMetadata(f"{where}: backend.type must be a non-empty string")
        archs = backend.get("archs")
        if archs is not None and (
            not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)
        ):
            raise InvalidMetadata(f"{where}: backend.archs must be a list of strings")
        deps = need("python-depends", list)
        if not all(isinstance(d, str) and d for d in deps):
            raise InvalidMetadata(f"{where}: python-depends must be a list of package names")
        minver = raw.get("kernels-minver")
        if minver is not None and (not isinstance(minver, str) or not _MINVER.match(minver)):
            raise InvalidMetadata(f"{where}: kernels-minver must look like X.Y.Z, got {minver!r}")
        kdeps = []
        listed = raw.get("kernel-depends", []) or []
        if not isinstance(listed, list):
            raise InvalidMetadata(f"{where}: kernel-depends must be a list")
        if listed:
            from .metadata_extras import KernelDependency
        for item in listed:
            if (
                not isinstance(item, dict)
                or not isinstance(item.get("repo-id"), str)
                or not isinstance(item.get("version"), int)
            ):
                raise InvalidMetadata(
                    f"{where}: kernel-depends entries need 'repo-id' (str) and 'version' (int)"
                )
            kdeps.append(KernelDependency(item["repo-id"], item["version"]))
        return cls(
            name=KernelName(name),
            id=ident,
            version=version,
            license=license_,
            backend=dict(backend),
            python_depends=tuple(deps),
            kernels_minver=minver,
            kernel_depends=tuple(kdeps),
            raw=raw,
        )
