"""What a kernelize call did (or, in a dry run, would do), module by module.

kernelize records its report on the model; `last_report(model)` returns it. `apply_kernels`
returns its report. `str(report)` is a table.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .fallback import KernelizeFallback
from .mode import Mode, mode_name

BOUND = "bound"  # the module runs the kernel's forward
ORIGINAL = "original"  # the module keeps (or got back) its original forward
SKIPPED = "skipped"  # kernel_condition said no for this instance
PLANNED = "would bind"  # dry run: this kernel would be bound
BLOCKED = "would raise"  # dry run: a real run would raise (the fallback flags forbid keeping it)
ROUTED = "routed"  # calls another library makes (TRL's fused LM head) go to this kernel

_REPORT = "_kernels_last_report"  # model.__dict__ key
_COMMIT = re.compile(r"(?<=@)[0-9a-f]{40}")  # shown as 12 hex in the table


@dataclass(frozen=True)
class BindEntry:
    """One module (or one function a module calls) and what happened to it.

    `path` is the module path, with `.<name>` appended for a function the module calls;
    `kernel` is "repo@commit/variant:Layer" once bound (the request, in a dry run);
    `reason` says why the original forward was kept; `fallback` names that case.
    """

    path: str
    layer_name: str
    status: str
    kernel: str | None = None
    mode: Mode | None = None
    reason: str = ""
    fallback: KernelizeFallback | None = None


@dataclass(frozen=True)
class BindReport:
    """Every kernelizable module of one model, for one mode and device."""

    model: str
    mode: Mode
    device: str
    entries: tuple[BindEntry, ...]
    dry_run: bool = False

    def __iter__(self) -> Iterator[BindEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, path: str) -> BindEntry:
        for entry in self.entries:
            if entry.path == path:
                return entry
        raise KeyError(path)

    @property
    def bound(self) -> tuple[BindEntry, ...]:
        return tuple(e for e in self.entries if e.status in (BOUND, PLANNED))

    @property
    def kept(self) -> tuple[BindEntry, ...]:
        return tuple(e for e in self.entries if e.status not in (BOUND, PLANNED, ROUTED))

    def __str__(self) -> str:
        title = "plan (dry run)" if self.dry_run else "kernelize"
        counts: dict[str, int] = {}
        for entry in self.entries:
            counts[entry.status] = counts.get(entry.status, 0) + 1
        summary = (
            ", ".join(f"{n} {status}" for status, n in counts.items()) or "nothing to kernelize"
        )
        head = f"{title} {self.model}  mode={mode_name(self.mode)}  device={self.device}: {summary}"
        rows = [("module", "layer", "result", "detail")]
        for e in self.entries:
            detail = _COMMIT.sub(lambda m: m.group(0)[:12], e.kernel or "")
            if e.mode not in (None, Mode.FALLBACK) and e.status in (BOUND, PLANNED):
                detail += f" [{mode_name(e.mode)}]"
            if e.reason:
                detail = f"{detail}  ({e.reason})" if detail else e.reason
            rows.append((e.path or "<root>", e.layer_name, e.status, detail))
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [head]
        for row in rows:
            cells = [row[i].ljust(widths[i]) for i in range(3)]
            lines.append("  ".join([*cells, row[3]]).rstrip())
        return "\n".join(lines)


def last_report(model: Any) -> BindReport | None:
    """The report of the last (non-dry) kernelize call on `model`, if any."""
    return getattr(model, "__dict__", {}).get(_REPORT)


def record(model: Any, report: BindReport) -> None:
    model.__dict__[_REPORT] = report


def kernel_origin(layer: type, repo: Any) -> str:
    """ "org/repo@<commit>/<variant>:Layer" (or "<path>/<variant>:Layer") for a loaded layer;
    the request itself when the layer does not come from a kernel this package imported."""
    from ..importer import loaded_kernel_of

    name = getattr(repo, "layer_name", None) or layer.__name__
    module = sys.modules.get(layer.__module__)
    loaded = loaded_kernel_of(module) if module is not None else None
    if loaded is None:
        return str(repo) if getattr(repo, "layer_name", None) else f"{repo}:{name}"
    info = loaded.repo_info
    if info is None:  # a local kernel: its variant folder says it all
        return f"{loaded.path}:{name}"
    return f"{info.repo_id}@{info.revision}/{loaded.variant}:{name}"
