"""The optional parts of a metadata.json as value types: `kernel-depends` and `provenance`.

They live apart from metadata.py because most kernels have neither, and a frozen dataclass costs
a few hundred microseconds to create: a warm load of such a kernel never imports this module.
kernels.metadata re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelDependency:
    repo_id: str
    version: int


@dataclass(frozen=True)
class GitStatus:
    """The git state a build was made from: the commit and whether the tree was dirty."""

    commit: str
    dirty: bool = False


@dataclass(frozen=True)
class KernelBuilderVersion:
    """The kernel-builder that made the build; `git` is None when its revision is unknown."""

    version: str
    git: GitStatus | None = None


@dataclass(frozen=True)
class Provenance:
    """Build provenance (metadata.json `provenance`), shaped as the reference exposes it."""

    kernel_builder: KernelBuilderVersion
    kernel: GitStatus | None = None

    @property
    def dirty(self) -> bool:
        """True when the kernel source or the kernel-builder had uncommitted changes."""
        builder = self.kernel_builder.git
        return bool((builder is not None and builder.dirty) or (self.kernel and self.kernel.dirty))

    def dirty_sources(self) -> list[str]:
        """Which of "kernel source" and "kernel-builder" were built from a dirty tree."""
        out = []
        if self.kernel is not None and self.kernel.dirty:
            out.append("kernel source")
        if self.kernel_builder.git is not None and self.kernel_builder.git.dirty:
            out.append("kernel-builder")
        return out


def _git_status(raw: object) -> GitStatus | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("commit"), str):
        return None
    return GitStatus(raw["commit"], raw.get("dirty") is True)


def parse_provenance(raw: object) -> Provenance | None:
    """Parse `provenance`; a malformed block reads as absent (it is advisory, never a reason
    to refuse a kernel)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("kernel-builder"), dict):
        return None
    builder = raw["kernel-builder"]
    version = builder.get("version")
    return Provenance(
        KernelBuilderVersion(str(version) if version is not None else "", _git_status(builder)),
        _git_status(raw.get("kernel")),
    )
