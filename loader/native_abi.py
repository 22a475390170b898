"""A pure-Python ELF probe, run on a variant's native libraries before any of them is loaded.

`read_elf` (elf.py) reads what the dynamic loader will check: the ELF class, byte order and
machine, the DT_NEEDED sonames, and the symbol versions the library requires (GLIBC, GLIBCXX,
CXXABI). `check_native_files` turns a mismatch with this machine into one readable line per
problem instead of an `OSError` from dlopen, or a crash. Damaged files give an `ElfInfo` whose
`problem` says what is wrong; nothing raises.

The ELF reader is imported when there is a file to read: every load imports this module (for
`normalize_machine` and the check), and most kernels ship no native library.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .elf import ElfInfo, read_elf

__all__ = [
    "ElfInfo",
    "check_native_files",
    "find_native_files",
    "normalize_machine",
    "read_elf",
    "system_glibc",
    "system_glibcxx",
]


def __getattr__(name: str):
    # The reader's names, re-exported from elf.py on first use.
    if name in ("ElfInfo", "read_elf"):
        from . import elf

        return getattr(elf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# platform.machine() spellings -> one name per architecture.
_MACHINE_ALIASES = {
    "arm64": "aarch64",
    "amd64": "x86_64",
    "x64": "x86_64",
    "i386": "x86",
    "i486": "x86",
    "i586": "x86",
    "i686": "x86",
    "armv7l": "arm",
    "armv6l": "arm",
}


def normalize_machine(machine: str) -> str:
    """One name per CPU architecture: arm64 -> aarch64, AMD64 -> x86_64, i686 -> x86."""
    name = machine.strip().lower()
    return _MACHINE_ALIASES.get(name, name)


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def system_glibc() -> tuple[int, int] | None:
    """This process's glibc version, e.g. (2, 36); None on musl, macOS and Windows."""
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None
    m = re.fullmatch(r"glibc ([0-9]+)\.([0-9]+).*", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def system_glibcxx() -> tuple[int, ...] | None:
    """Highest GLIBCXX version of the libstdc++ this process uses (loading it if needed).

    Linux only (None elsewhere, or when no libstdc++ is found). The library already mapped into
    the process (torch loads one) is the one a kernel's library will bind to.
    """
    if not sys.platform.startswith("linux"):
        return None
    path = _mapped_library("libstdc++.so")
    if path is None:
        import ctypes

        try:
            ctypes.CDLL("libstdc++.so.6")
        except OSError:
            return None
        path = _mapped_library("libstdc++.so")
    if path is None:
        return None
    from .elf import highest_version, read_elf

    try:
        info = read_elf(path)
    except OSError:
        return None
    if info is None:
        return None
    return highest_version(name for name in info.defines if name.startswith("GLIBCXX_"))


def _mapped_library(prefix: str) -> str | None:
    """Path of a shared library mapped into this process whose file name starts with `prefix`."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if path.startswith("/") and os.path.basename(path).startswith(prefix):
                    return path
    except OSError:
        return None
    return None


def find_native_files(root: str | os.PathLike) -> list[Path]:
    """Every shared library under `root` (`*.so` and `*.so.N`), sorted, for check_native_files."""
    found = [
        p for p in Path(root).rglob("*") if p.is_file() and (p.suffix == ".so" or ".so." in p.name)
    ]
    return sorted(found)


def check_native_files(
    paths: Iterable[str | os.PathLike],
    *,
    machine: str | None = None,
    glibc: tuple[int, int] | None = None,
    glibcxx: tuple[int, ...] | None = None,
) -> list[str]:
    """One message per problem that would stop these libraries loading here; [] when fine.

    `machine`, `glibc` and `glibcxx` default to this machine's (glibcxx is looked up only when a
    file requires GLIBCXX). A requirement is not checked when this machine's side is unknown.
    """
    from .elf import read_elf

    machine = normalize_machine(machine or platform.machine())
    if glibc is None:
        glibc = system_glibc()
    on_linux = sys.platform.startswith("linux")
    problems: list[str] = []
    for path in paths:
        name = Path(path).name
        try:
            info = read_elf(path)
        except OSError as err:
            problems.append(f"{name} cannot be read: {err.strerror or err}")
            continue
        if info is None:
            if on_linux:  # elsewhere native libraries are Mach-O or PE, not ELF
                problems.append(f"{name} is not an ELF shared library")
            continue
        if info.problem:
            problems.append(f"{name} is damaged: {info.problem}")
        if info.machine and info.machine != machine:
            problems.append(f"{name} is built for {info.machine} but this machine is {machine}")
        if info.glibc and glibc and info.glibc > glibc:
            problems.append(
                f"{name} needs GLIBC {_dotted(info.glibc)} "
                f"but this system has GLIBC {_dotted(glibc)}"
            )
        if info.glibcxx:
            if glibcxx is None:
                glibcxx = system_glibcxx() or ()  # () = looked up, unknown: skip the check
            if glibcxx and info.glibcxx > glibcxx:
                problems.append(
                    f"{name} needs GLIBCXX {_dotted(info.glibcxx)} "
                    f"but this process's libstdc++ has GLIBCXX {_dotted(glibcxx)}"
                )
    return problems
