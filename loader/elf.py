"""Read an ELF file's header, dynamic section and symbol-version tables (pure Python).

`read_elf` reads what the dynamic loader will check: the ELF class, byte order and machine, the
DT_NEEDED sonames, and the symbol versions the library requires (GLIBC, GLIBCXX, CXXABI) from the
version-needs table that the dynamic section points at. It reads through the program headers
(what ld.so uses), so stripped section tables do not matter. Damaged files give an `ElfInfo`
whose `problem` says what is wrong; nothing raises.

native_abi.py decides what the result means for this machine; it imports this module only when
a variant has native libraries, so a warm load of a pure-Python kernel does not pay for it.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass

_ELF_MAGIC = b"\x7fELF"

# e_machine -> the name `platform.machine()` gives on Linux (after native_abi.normalize_machine).
_MACHINES_64 = {62: "x86_64", 183: "aarch64", 22: "s390x", 243: "riscv64", 258: "loongarch64"}
_MACHINES_32 = {3: "x86", 40: "arm", 22: "s390", 243: "riscv32", 8: "mips"}
_EM_PPC64 = 21  # the byte order tells ppc64 from ppc64le

_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_STRSZ = 0, 1, 5, 10
_DT_VERDEF, _DT_VERDEFNUM = 0x6FFFFFFC, 0x6FFFFFFD
_DT_VERNEED, _DT_VERNEEDNUM = 0x6FFFFFFE, 0x6FFFFFFF
_VER_FLG_BASE = 1  # the verdef entry that names the library itself, not a version
_MAX_ENTRIES = 1 << 16  # bounds every walk, so a cycle in a damaged table cannot loop forever

# Version nodes that name a glibc feature instead of a release; the release that added it.
_GLIBC_MARKERS = {"GLIBC_ABI_DT_RELR": (2, 36)}
_VERSION_NAME = re.compile(r"^(GLIBC|GLIBCXX|CXXABI)_([0-9]+(?:\.[0-9]+)*)\Z")


@dataclass(frozen=True)
class ElfInfo:
    """What the dynamic loader will demand of this machine to load one ELF file.

    `problem` is set when the file is damaged (truncated, offsets out of range); fields that could
    not be read are then None or empty. Version tuples are the highest version required.
    """

    path: str
    bits: int | None = None  # 32 or 64
    endian: str | None = None  # "little" or "big"
    machine: str | None = None  # normalised like platform.machine(): "x86_64", "aarch64", ...
    needed: tuple[str, ...] = ()  # DT_NEEDED sonames, in file order
    requires: tuple[tuple[str, str], ...] = ()  # (soname, version name) pairs, e.g. GLIBC_2.34
    defines: tuple[str, ...] = ()  # version names the file itself provides (its verdef table)
    glibc: tuple[int, ...] | None = None
    glibcxx: tuple[int, ...] | None = None
    cxxabi: tuple[int, ...] | None = None
    problem: str | None = None


class _Damaged(Exception):
    """Internal: the file breaks the ELF format; the message becomes `ElfInfo.problem`."""


def _machine_name(e_machine: int, bits: int, endian: str) -> str:
    if e_machine == _EM_PPC64:
        return "ppc64le" if endian == "little" else "ppc64"
    table = _MACHINES_64 if bits == 64 else _MACHINES_32
    return table.get(e_machine, f"machine {e_machine}")


class _Reader:
    """Bounds-checked struct reads over the mapped file."""

    def __init__(self, data: bytes | mmap.mmap, endian: str):
        self.data = data
        self.size = len(data)
        self.prefix = "<" if endian == "little" else ">"

    def unpack(self, fmt: str, offset: int, what: str) -> tuple:
        st = struct.Struct(self.prefix + fmt)
        if offset < 0 or offset + st.size > self.size:
            raise _Damaged(f"{what} at offset {offset} runs past the end of the file")
        return st.unpack_from(self.data, offset)

    def cstring(self, offset: int, limit: int, what: str) -> str:
        if offset < 0 or offset >= min(limit, self.size):
            raise _Damaged(f"{what} points outside the string table")
        end = self.data.find(b"\0", offset, min(limit, self.size))
        if end < 0:
            raise _Damaged(f"{what} is not NUL-terminated")
        return bytes(self.data[offset:end]).decode("utf-8", "replace")


def read_elf(path: str | os.PathLike) -> ElfInfo | None:
    """Read an ELF file's class, machine, DT_NEEDED and required versions; None if not ELF.

    Raises OSError only when the file cannot be opened; damage is reported in `problem`.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(16)
        if head[:4] != _ELF_MAGIC:
            return None
        f.seek(0)
        # mmap: native libraries reach hundreds of MB and only a few KB of them are read here.
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(path, head, data)


def _parse(path: str, head: bytes, data: mmap.mmap) -> ElfInfo:
    bits = {1: 32, 2: 64}.get(head[4]) if len(head) > 4 else None
    endian = {1: "little", 2: "big"}.get(head[5]) if len(head) > 5 else None
    header_size = 64 if bits == 64 else 52
    if len(data) < header_size:
        return ElfInfo(path, problem=f"the file ends inside the ELF header ({len(data)} bytes)")
    if bits is None or endian is None:
        return ElfInfo(path, problem=f"unknown ELF class {head[4]} or byte order {head[5]}")
    reader = _Reader(data, endian)
    info = {"bits": bits, "endian": endian}
    try:
        header = "HHIQQQIHHHHHH" if bits == 64 else "HHIIIIIHHHHHH"
        (_, e_machine, _, _, e_phoff, _, _, _, e_phentsize, e_phnum, *_) = reader.unpack(
            header, 16, "ELF header"
        )
        info["machine"] = _machine_name(e_machine, bits, endian)
        info.update(_dynamic_info(reader, bits, e_phoff, e_phentsize, e_phnum))
    except _Damaged as err:
        return ElfInfo(path, problem=str(err), **info)
    return ElfInfo(path, **info)


def _dynamic_info(reader: _Reader, bits: int, phoff: int, phentsize: int, phnum: int) -> dict:
    phdr = "IIQQQQQQ" if bits == 64 else "IIIIIIII"
    if phnum and phentsize != struct.calcsize("<" + phdr):
        raise _Damaged(f"program header entry size {phentsize} is wrong for ELF{bits}")
    loads: list[tuple[int, int, int]] = []  # (vaddr, offset, filesz)
    dynamic: tuple[int, int] | None = None  # (offset, filesz)
    for i in range(phnum):
        fields = reader.unpack(phdr, phoff + i * phentsize, "program header")
        if bits == 64:
            p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = fields
        else:
            p_type, p_offset, p_vaddr, _, p_filesz, _, _, _ = fields
        if p_type == _PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == _PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
    # ld.so maps every loadable segment from the file; a shorter file is a cut-off download.
    need = max((off + size for _, off, size in loads), default=0)
    if need > reader.size:
        raise _Damaged(
            f"the file has {reader.size} bytes but its segments need {need} (cut short?)"
        )
    if dynamic is None:
        return {}  # statically linked: nothing needed, no versions

    def to_offset(vaddr: int, what: str) -> int:
        for seg_vaddr, seg_offset, seg_size in loads:
            if seg_vaddr <= vaddr < seg_vaddr + seg_size:
                return vaddr - seg_vaddr + seg_offset
        raise _Damaged(f"{what} address {vaddr:#x} is in no loaded segment")

    tags: dict[int, int] = {}
    needed_names: list[int] = []
    dyn, step = ("qQ", 16) if bits == 64 else ("iI", 8)
    dyn_offset, dyn_size = dynamic
    for i in range(min(dyn_size // step, _MAX_ENTRIES)):
        tag, value = reader.unpack(dyn, dyn_offset + i * step, "dynamic entry")
        if tag == _DT_NULL:
            break
        if tag == _DT_NEEDED:
            needed_names.append(value)
        else:
            tags.setdefault(tag, value)
    if not needed_names and _DT_VERNEED not in tags and _DT_VERDEF not in tags:
        return {}
    if _DT_STRTAB not in tags:
        raise _Damaged("the dynamic section has no string table")
    strtab = to_offset(tags[_DT_STRTAB], "string table")
    strend = strtab + tags.get(_DT_STRSZ, reader.size - strtab)

    def string(index: int, what: str) -> str:
        return reader.cstring(strtab + index, strend, what)

    needed = tuple(string(n, "a DT_NEEDED name") for n in needed_names)
    requires: list[tuple[str, str]] = []
    if _DT_VERNEED in tags:
        count = min(tags.get(_DT_VERNEEDNUM, _MAX_ENTRIES), _MAX_ENTRIES)
        offset = to_offset(tags[_DT_VERNEED], "version-needs table")
        for _ in range(count):
            _, vn_cnt, vn_file, vn_aux, vn_next = reader.unpack("HHIII", offset, "version need")
            soname = string(vn_file, "a version-need file name")
            aux = offset + vn_aux
            for _ in range(vn_cnt):
                _, _, _, vna_name, vna_next = reader.unpack("IHHII", aux, "version need entry")
                requires.append((soname, string(vna_name, "a required version name")))
                if vna_next == 0:
                    break
                aux += vna_next
            if vn_next == 0:
                break
            offset += vn_next
    defines: list[str] = []
    if _DT_VERDEF in tags:
        count = min(tags.get(_DT_VERDEFNUM, _MAX_ENTRIES), _MAX_ENTRIES)
        offset = to_offset(tags[_DT_VERDEF], "version-definitions table")
        for _ in range(count):
            _, vd_flags, _, vd_cnt, _, vd_aux, vd_next = reader.unpack(
                "HHHHIII", offset, "version definition"
            )
            if vd_cnt and not vd_flags & _VER_FLG_BASE:
                (vda_name, _) = reader.unpack("II", offset + vd_aux, "version definition name")
                defines.append(string(vda_name, "a defined version name"))
            if vd_next == 0:
                break
            offset += vd_next
    return {
        "needed": needed,
        "requires": tuple(requires),
        "defines": tuple(defines),
        "glibc": highest_version(name for _, name in requires if name.startswith("GLIBC_")),
        "glibcxx": highest_version(name for _, name in requires if name.startswith("GLIBCXX_")),
        "cxxabi": highest_version(name for _, name in requires if name.startswith("CXXABI_")),
    }


def _version_of(name: str) -> tuple[int, ...] | None:
    if name in _GLIBC_MARKERS:
        return _GLIBC_MARKERS[name]
    m = _VERSION_NAME.match(name)
    return tuple(int(p) for p in m.group(2).split(".")) if m else None


def highest_version(names: Iterable[str]) -> tuple[int, ...] | None:
    """The highest numbered version among `names` (GLIBC_PRIVATE and the like are skipped)."""
    versions = [v for v in map(_version_of, names) if v is not None]
    return max(versions, default=None)
