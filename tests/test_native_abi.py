"""The ELF probe against real compiled libraries, this system's own libraries, crafted ELF files
of other machines, and damaged files. Where it matters, the real dynamic loader is the oracle."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels.native_abi import (
    ElfInfo,
    check_native_files,
    find_native_files,
    normalize_machine,
    read_elf,
    system_glibc,
    system_glibcxx,
)

LINUX = sys.platform.startswith("linux")
HOST = normalize_machine(platform.machine())
linux_only = pytest.mark.skipif(not LINUX, reason="ELF shared libraries and glibc are Linux's")
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
needs_readelf = pytest.mark.skipif(shutil.which("readelf") is None, reason="no readelf")

C_SOURCE = """
#include <stdio.h>
#include <string.h>
int probe_hello(const char *s) { puts(s); return (int)strlen(s); }
"""
CXX_SOURCE = """
#include <string>
#include <sstream>
extern "C" int probe_len(const char *s) {
    std::ostringstream out; out << std::string(s) << 42; return (int)out.str().size();
}
"""


def compile_library(folder: Path, source: str, name: str, compiler: str = "gcc") -> Path:
    src = folder / (name + (".cpp" if compiler == "g++" else ".c"))
    src.write_text(source)
    out = folder / name
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(out), str(src)], check=True)
    return out


def _no_core_dumps() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def loads(path: Path) -> tuple[bool, str]:
    """Whether the real dynamic loader accepts `path` (in a child: a bad file may crash it)."""
    code = "import ctypes, sys; ctypes.CDLL(sys.argv[1])"
    result = subprocess.run(
        [sys.executable, "-S", "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_no_core_dumps,
    )
    return result.returncode == 0, result.stderr


def mapped(pattern: str) -> Path | None:
    """A library mapped into this process whose file name matches `pattern`."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split(maxsplit=5)[-1].strip()
            if path.startswith("/") and re.fullmatch(pattern, os.path.basename(path)):
                return Path(path)
    return None


def elf_hash(name: bytes) -> int:
    """The SysV ELF hash stored next to each required version name."""
    h = 0
    for c in name:
        h = ((h << 4) + c) & 0xFFFFFFFF
        g = h & 0xF0000000
        if g:
            h ^= g >> 24
        h &= ~g & 0xFFFFFFFF
    return h


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    if shutil.which("gcc") is None or not LINUX:
        pytest.skip("needs gcc on Linux")
    return compile_library(tmp_path_factory.mktemp("built"), C_SOURCE, "libprobe.so")


# --- real libraries ---------------------------------------------------------------------------


@linux_only
@needs_gcc
def test_compiled_library_matches_this_machine(built):
    info = read_elf(built)
    assert info.problem is None
    assert info.machine == HOST
    assert info.bits == (64 if sys.maxsize > 2**32 else 32)
    assert info.endian == sys.byteorder
    assert "libc.so.6" in info.needed
    assert info.glibc is not None and info.glibc <= system_glibc()
    assert all(soname == "libc.so.6" for soname, _ in info.requires)
    assert info.glibcxx is None and info.cxxabi is None
    assert check_native_files([built]) == []
    assert loads(built)[0]


@linux_only
@needs_gcc
@needs_readelf
def test_agrees_with_readelf(built):
    libc = _libc()
    for path in (built, libc):
        info = read_elf(path)
        dyn = subprocess.run(["readelf", "-dW", str(path)], capture_output=True, text=True).stdout
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn)
        assert list(info.needed) == needed
        ver = subprocess.run(["readelf", "-VW", str(path)], capture_output=True, text=True).stdout
        need_part = ver.split("Version needs section", 1)[-1] if "needs section" in ver else ""
        required = set(re.findall(r"Name: (\S+)\s+Flags", need_part))
        assert {name for _, name in info.requires} == required
        if "Version definition section" in ver:
            def_part = ver.split("Version definition section", 1)[1].split("Version needs", 1)[0]
            defined = re.findall(r"Flags: (\S+)\s+Index: \d+\s+Cnt: \d+\s+Name: (\S+)", def_part)
            assert list(info.defines) == [name for flags, name in defined if flags != "BASE"]


def _libc() -> Path:
    ctypes.CDLL(ctypes.util.find_library("c"))  # already loaded; this only makes sure
    path = mapped(r"libc\.so\.6|libc-[0-9.]+\.so")
    assert path is not None, "libc is not mapped into this process"
    return path


@linux_only
def test_system_libc_defines_this_glibc():
    glibc = system_glibc()
    if glibc is None:
        pytest.skip("not a glibc system")
    info = read_elf(_libc())
    assert info.problem is None and info.machine == HOST
    defined = [tuple(map(int, n[6:].split("."))) for n in info.defines if re.match(r"GLIBC_\d", n)]
    assert max(defined)[:2] == glibc  # confstr and libc's own version table agree
    assert not any(name.startswith("libc.so") for name in info.defines)  # the base entry


@linux_only
@needs_gxx
@needs_readelf
def test_cpp_library_needs_glibcxx_this_process_has(tmp_path):
    lib = compile_library(tmp_path, CXX_SOURCE, "libcxx.so", compiler="g++")
    info = read_elf(lib)
    assert "libstdc++.so.6" in info.needed
    assert info.glibcxx is not None and info.glibcxx[:2] == (3, 4)
    have = system_glibcxx()
    assert have is not None and info.glibcxx <= have
    # the number matches the newest GLIBCXX version that readelf sees in the mapped libstdc++
    stdcxx = mapped(r"libstdc\+\+\.so.*")
    ver = subprocess.run(["readelf", "-VW", str(stdcxx)], capture_output=True, text=True).stdout
    names = re.findall(r"Name: GLIBCXX_([0-9.]+)\n", ver)
    assert have == max(tuple(map(int, n.split("."))) for n in names)
    assert check_native_files([lib]) == []
    assert loads(lib)[0]


@linux_only
def test_torch_libraries_pass():
    # Every library torch ships is loadable here (torch is imported in this suite), so the probe
    # must find nothing wrong with any of them: no false alarms on real, large libraries.
    torch = pytest.importorskip("torch")
    libs = find_native_files(Path(torch.__file__).parent)
    assert libs, "torch ships native libraries"
    assert check_native_files(libs) == []
    biggest = max(libs, key=lambda p: p.stat().st_size)
    info = read_elf(biggest)
    assert info.machine == HOST and info.needed and info.glibc is not None


@linux_only
def test_python_executable():
    info = read_elf(os.path.realpath(sys.executable))
    if info is None:
        pytest.skip("the interpreter is not an ELF file here")
    assert info.problem is None and info.machine == HOST


# --- patched copies: a newer GLIBC, another machine -------------------------------------------


@linux_only
@needs_gcc
def test_requirement_on_a_newer_glibc(built, tmp_path):
    data = bytearray(built.read_bytes())
    old = next(n for _, n in read_elf(built).requires if re.fullmatch(r"GLIBC_2\.[0-9.]+", n))
    new = "GLIBC_9." + "9" * (len(old) - 8)  # same length, so no offset moves
    # the name lives once in the dynamic string table, NUL-delimited on both sides
    assert data.count(b"\0" + old.encode() + b"\0") == 1
    data = data.replace(b"\0" + old.encode() + b"\0", b"\0" + new.encode() + b"\0")
    # keep the file consistent: the version entry stores the hash of its name
    old_hash = struct.pack("<I" if sys.byteorder == "little" else ">I", elf_hash(old.encode()))
    new_hash = struct.pack("<I" if sys.byteorder == "little" else ">I", elf_hash(new.encode()))
    assert data.count(old_hash) == 1
    data = data.replace(old_hash, new_hash)
    patched = tmp_path / "_ops.so"
    patched.write_bytes(bytes(data))

    info = read_elf(patched)
    assert ("libc.so.6", new) in info.requires
    assert info.glibc == (9, int(new[8:]))
    have = system_glibc()
    assert check_native_files([patched]) == [
        f"_ops.so needs GLIBC 9.{new[8:]} but this system has GLIBC {have[0]}.{have[1]}"
    ]
    ok, err = loads(patched)  # the real loader refuses it for the same reason
    assert not ok and new in err and "not found" in err


@linux_only
@needs_gcc
def test_explicit_glibc_of_another_system(built):
    need = read_elf(built).glibc
    older = (need[0], need[1] - 1) if need[1] > 0 else (need[0] - 1, 99)
    assert check_native_files([built], glibc=older) == [
        f"libprobe.so needs GLIBC {'.'.join(map(str, need))} "
        f"but this system has GLIBC {older[0]}.{older[1]}"
    ]
    assert check_native_files([built], glibc=(need[0], need[1] + 1)) == []


@linux_only
@needs_gcc
def test_built_for_another_machine(built, tmp_path):
    other, code = ("aarch64", 183) if HOST != "aarch64" else ("x86_64", 62)
    data = bytearray(built.read_bytes())
    struct.pack_into("<H" if sys.byteorder == "little" else ">H", data, 18, code)  # e_machine
    patched = tmp_path / "_ops.so"
    patched.write_bytes(bytes(data))
    assert read_elf(patched).machine == other
    assert check_native_files([patched]) == [
        f"_ops.so is built for {other} but this machine is {HOST}"
    ]
    assert not loads(patched)[0]
    # the same file judged from the other machine's side
    assert check_native_files([built], machine=other) == [
        f"libprobe.so is built for {HOST} but this machine is {other}"
    ]


# --- truncated, damaged and foreign files -----------------------------------------------------


@linux_only
@needs_gcc
def test_truncated_library(built, tmp_path):
    data = built.read_bytes()

    def probe(cut: int) -> tuple[Path, ElfInfo | None]:
        path = tmp_path / f"cut{cut}.so"
        path.write_bytes(data[:cut])
        return path, read_elf(path)

    def fine(info: ElfInfo | None) -> bool:
        return info is not None and info.problem is None

    # where the probe's verdict flips from damaged to fine (it is monotonic in the cut)
    lo, hi = 0, len(data)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fine(probe(mid)[1]) else (mid + 1, hi)
    flip = lo
    if shutil.which("readelf"):  # the flip is exactly where the last loaded segment ends
        headers = subprocess.run(["readelf", "-lW", str(built)], capture_output=True, text=True)
        loads_ = re.findall(r"LOAD\s+(0x[0-9a-f]+)\s+\S+\s+\S+\s+(0x[0-9a-f]+)", headers.stdout)
        assert flip == max(int(off, 16) + int(size, 16) for off, size in loads_)
    cuts = {0, 3, 4, 16, 40, 63, 64, 65, flip - 64, flip - 1, flip, len(data) - 1}
    cuts |= set(range(0, len(data), max(1, len(data) // 12)))
    loader_refused = 0
    for cut in sorted(c for c in cuts if 0 <= c < len(data)):
        path, info = probe(cut)
        assert fine(info) == (cut >= flip)
        loaded, _ = loads(path)
        # Whatever the probe passes, the loader loads. The converse does not hold: a file cut
        # inside its last page loads with zeros for the missing bytes, and one cut just before
        # a page boundary can kill the process with SIGBUS; the probe flags both.
        assert loaded or not fine(info), f"the probe passed a file the loader refuses: {cut}"
        loader_refused += not loaded
        if not fine(info):
            (problem,) = check_native_files([path]) or [""]
            assert problem.startswith(f"cut{cut}.so is "), problem
    assert loader_refused > 5


@pytest.mark.parametrize(
    "content",
    [b"", b"\x7fEL", b"hello world\n", b"MZ\x90\x00" + bytes(60), b"\xcf\xfa\xed\xfe" + bytes(60)],
    ids=["empty", "3-bytes-of-magic", "text", "pe", "mach-o"],
)
def test_not_elf(tmp_path, content):
    path = tmp_path / "lib.so"
    path.write_bytes(content)
    assert read_elf(path) is None
    expected = ["lib.so is not an ELF shared library"] if LINUX else []
    assert check_native_files([path]) == expected


@pytest.mark.parametrize(
    "content,problem",
    [
        (b"\x7fELF", "the file ends inside the ELF header (4 bytes)"),
        (b"\x7fELF\x02\x01\x01" + bytes(30), "the file ends inside the ELF header (37 bytes)"),
        (b"\x7fELF\x01\x01\x01" + bytes(40), "the file ends inside the ELF header (47 bytes)"),
        (b"\x7fELF\x03\x01\x01" + bytes(60), "unknown ELF class 3 or byte order 1"),
        (b"\x7fELF\x02\x07\x01" + bytes(60), "unknown ELF class 2 or byte order 7"),
    ],
)
def test_damaged_header(tmp_path, content, problem):
    path = tmp_path / "lib.so"
    path.write_bytes(content)
    info = read_elf(path)
    assert info == ElfInfo(str(path), problem=problem)
    assert check_native_files([path], machine=HOST) == [f"lib.so is damaged: {problem}"]


def test_unreadable_paths(tmp_path):
    (tmp_path / "dir.so").mkdir()
    problems = check_native_files([tmp_path / "missing.so", tmp_path / "dir.so"])
    assert problems[0] == "missing.so cannot be read: No such file or directory"
    assert problems[1].startswith("dir.so cannot be read: ")
    with pytest.raises(FileNotFoundError):
        read_elf(tmp_path / "missing.so")


# --- crafted ELF files: other classes, byte orders and machines -------------------------------


def craft_elf(
    *,
    bits: int = 64,
    endian: str = "little",
    machine: int = 62,
    needed: tuple[str, ...] = ("libc.so.6",),
    requires: tuple[tuple[str, str], ...] = (("libc.so.6", "GLIBC_2.17"),),
) -> tuple[bytes, dict[str, int]]:
    """A minimal ELF shared object built from the spec: one PT_LOAD over the whole file, a
    PT_DYNAMIC, a string table and a version-needs table. Returns the bytes and the offsets."""
    e = "<" if endian == "little" else ">"
    ehsize, phentsize = (64, 56) if bits == 64 else (52, 32)
    strtab = bytearray(b"\0")

    def add(text: str) -> int:
        strtab.extend(text.encode() + b"\0")
        return len(strtab) - len(text) - 1

    needed_at = [add(n) for n in needed]
    groups: dict[str, list[str]] = {}
    for soname, name in requires:
        groups.setdefault(soname, []).append(name)
    file_at = {so: add(so) for so in groups}
    name_at = {(so, n): add(n) for so, names in groups.items() for n in names}
    strtab_off = ehsize + 2 * phentsize
    verneed_off = (strtab_off + len(strtab) + 7) & ~7
    verneed = bytearray()
    for i, (so, names) in enumerate(groups.items()):
        size = 16 + 16 * len(names)
        vn_next = 0 if i == len(groups) - 1 else size
        verneed += struct.pack(e + "HHIII", 1, len(names), file_at[so], 16, vn_next)
        for j, n in enumerate(names):
            vna_next = 0 if j == len(names) - 1 else 16
            verneed += struct.pack(
                e + "IHHII", elf_hash(n.encode()), 0, 2 + j, name_at[so, n], vna_next
            )
    dyn_off = (verneed_off + len(verneed) + 7) & ~7
    entries = [(1, at) for at in needed_at] + [(5, strtab_off), (10, len(strtab))]
    if groups:
        entries += [(0x6FFFFFFE, verneed_off), (0x6FFFFFFF, len(groups))]
    entries.append((0, 0))
    dyn = b"".join(struct.pack(e + ("qQ" if bits == 64 else "iI"), t, v) for t, v in entries)
    total = dyn_off + len(dyn)
    ident = b"\x7fELF" + bytes([bits // 32, 1 if endian == "little" else 2, 1]) + bytes(9)
    if bits == 64:
        header = struct.pack(
            e + "HHIQQQIHHHHHH", 3, machine, 1, 0, ehsize, 0, 0, ehsize, phentsize, 2, 64, 0, 0
        )
        load = struct.pack(e + "IIQQQQQQ", 1, 5, 0, 0, 0, total, total, 0x1000)
        dynamic = struct.pack(
            e + "IIQQQQQQ", 2, 6, dyn_off, dyn_off, dyn_off, len(dyn), len(dyn), 8
        )
    else:
        header = struct.pack(
            e + "HHIIIIIHHHHHH", 3, machine, 1, 0, ehsize, 0, 0, ehsize, phentsize, 2, 40, 0, 0
        )
        load = struct.pack(e + "IIIIIIII", 1, 0, 0, 0, total, total, 5, 0x1000)
        dynamic = struct.pack(
            e + "IIIIIIII", 2, dyn_off, dyn_off, dyn_off, len(dyn), len(dyn), 6, 4
        )
    body = bytearray(ident + header + load + dynamic + strtab)
    body += bytes(verneed_off - len(body)) + verneed
    body += bytes(dyn_off - len(body)) + dyn
    assert len(body) == total
    layout = {"phoff": ehsize, "phentsize": phentsize, "strtab": strtab_off, "dynamic": dyn_off}
    layout["verneed"] = verneed_off
    return bytes(body), layout


@pytest.mark.parametrize(
    "bits,endian,code,name",
    [
        (64, "little", 62, "x86_64"),
        (64, "little", 183, "aarch64"),
        (64, "little", 21, "ppc64le"),
        (64, "big", 21, "ppc64"),
        (64, "big", 22, "s390x"),
        (64, "little", 243, "riscv64"),
        (64, "little", 258, "loongarch64"),
        (32, "little", 3, "x86"),
        (32, "little", 40, "arm"),
        (32, "big", 8, "mips"),
        (64, "little", 9999, "machine 9999"),
    ],
)
def test_crafted_machines(tmp_path, bits, endian, code, name):
    data, _ = craft_elf(bits=bits, endian=endian, machine=code)
    path = tmp_path / "lib.so"
    path.write_bytes(data)
    assert read_elf(path) == ElfInfo(
        str(path),
        bits=bits,
        endian=endian,
        machine=name,
        needed=("libc.so.6",),
        requires=(("libc.so.6", "GLIBC_2.17"),),
        glibc=(2, 17),
    )
    expected = [] if name == HOST else [f"lib.so is built for {name} but this machine is {HOST}"]
    assert check_native_files([path], glibc=(2, 17)) == expected


@pytest.mark.parametrize(
    "requires,glibc,glibcxx,cxxabi",
    [
        (
            (
                ("libc.so.6", "GLIBC_2.17"),
                ("libc.so.6", "GLIBC_2.34"),
                ("libc.so.6", "GLIBC_PRIVATE"),
                ("libm.so.6", "GLIBC_2.29"),
                ("libstdc++.so.6", "GLIBCXX_3.4.30"),
                ("libstdc++.so.6", "GLIBCXX_3.4.9"),
                ("libstdc++.so.6", "CXXABI_1.3.13"),
                ("libgcc_s.so.1", "GCC_3.0"),
            ),
            (2, 34),
            (3, 4, 30),
            (1, 3, 13),
        ),
        ((("libc.so.6", "GLIBC_2.2.5"), ("libc.so.6", "GLIBC_ABI_DT_RELR")), (2, 36), None, None),
        ((("libc.so.6", "GLIBC_PRIVATE"),), None, None, None),
        ((), None, None, None),
    ],
)
def test_required_versions(tmp_path, requires, glibc, glibcxx, cxxabi):
    sonames = tuple(dict.fromkeys(so for so, _ in requires)) or ("libc.so.6",)
    data, _ = craft_elf(needed=sonames, requires=requires)
    path = tmp_path / "lib.so"
    path.write_bytes(data)
    info = read_elf(path)
    assert info.needed == sonames
    assert info.requires == requires
    assert (info.glibc, info.glibcxx, info.cxxabi) == (glibc, glibcxx, cxxabi)


def test_glibcxx_check(tmp_path):
    data, _ = craft_elf(
        needed=("libstdc++.so.6",), requires=(("libstdc++.so.6", "GLIBCXX_3.4.32"),)
    )
    path = tmp_path / "_ops.so"
    path.write_bytes(data)
    assert check_native_files([path], machine="x86_64", glibcxx=(3, 4, 30)) == [
        "_ops.so needs GLIBCXX 3.4.32 but this process's libstdc++ has GLIBCXX 3.4.30"
    ]
    assert check_native_files([path], machine="x86_64", glibcxx=(3, 4, 32)) == []


def test_several_files_several_problems(tmp_path):
    good, _ = craft_elf(requires=(("libc.so.6", "GLIBC_2.17"),))
    bad, _ = craft_elf(machine=183, requires=(("libc.so.6", "GLIBC_2.39"),))
    (tmp_path / "a.so").write_bytes(good)
    (tmp_path / "b.so").write_bytes(bad)
    assert check_native_files(
        [tmp_path / "a.so", tmp_path / "b.so"], machine="x86_64", glibc=(2, 36)
    ) == [
        "b.so is built for aarch64 but this machine is x86_64",
        "b.so needs GLIBC 2.39 but this system has GLIBC 2.36",
    ]


def _patched(data: bytes, offset: int, fmt: str, *values) -> bytes:
    out = bytearray(data)
    struct.pack_into("<" + fmt, out, offset, *values)
    return bytes(out)


def _damage_cases():
    data, at = craft_elf(needed=("libc.so.6", "libm.so.6"))
    dyn = at["dynamic"]
    return [
        (
            "phentsize",
            _patched(data, 54, "H", 40),
            "program header entry size 40 is wrong for ELF64",
        ),
        (
            "phoff",
            _patched(data, 32, "Q", 1 << 40),
            "program header at offset 1099511627776 runs past the end of the file",
        ),
        (
            "segment",
            _patched(data, at["phoff"] + 32, "Q", len(data) + 1),
            f"the file has {len(data)} bytes but its segments need {len(data) + 1} (cut short?)",
        ),
        (
            "dynamic",
            _patched(data, at["phoff"] + 56 + 8, "Q", len(data) - 8),
            "dynamic entry at offset",
        ),
        (
            "strtab-address",
            _patched(data, dyn + 16 * 2 + 8, "Q", 1 << 30),
            "string table address 0x40000000 is in no loaded segment",
        ),
        (
            "needed-name",
            _patched(data, dyn + 8, "Q", 1 << 20),
            "a DT_NEEDED name points outside the string table",
        ),
        (
            "strsz",
            _patched(data, dyn + 16 * 3 + 8, "Q", 3),
            "a DT_NEEDED name is not NUL-terminated",
        ),
        (
            "verneed-address",
            _patched(data, dyn + 16 * 4 + 8, "Q", len(data) - 4),
            "version need at offset",
        ),
        (
            "no-strtab",
            _patched(data, dyn + 16 * 2, "q", 0x7000_0000),
            "the dynamic section has no string table",
        ),
    ]


@pytest.mark.parametrize("what,data,problem", _damage_cases(), ids=[c[0] for c in _damage_cases()])
def test_damaged_tables(tmp_path, what, data, problem):
    path = tmp_path / "lib.so"
    path.write_bytes(data)
    info = read_elf(path)
    assert info.problem is not None and info.problem.startswith(problem)
    assert info.machine == "x86_64"  # what could be read is still reported
    assert check_native_files([path], machine="x86_64")[0] == f"lib.so is damaged: {info.problem}"


@pytest.fixture(scope="module")
def fuzz_seeds(tmp_path_factory) -> tuple[Path, list[bytes]]:
    folder = tmp_path_factory.mktemp("fuzz")
    seeds = [craft_elf(bits=b, endian=e)[0] for b in (32, 64) for e in ("little", "big")]
    if shutil.which("gcc") and LINUX:
        seeds.append(compile_library(folder, C_SOURCE, "libseed.so").read_bytes())
    return folder, seeds


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_damaged_files_never_raise(fuzz_seeds, data):
    folder, seeds = fuzz_seeds
    blob = bytearray(data.draw(st.sampled_from(seeds)))
    # damage the headers and tables (the first KB of every seed) or anywhere in the file
    limit = data.draw(st.sampled_from([min(1024, len(blob)), len(blob)]))
    for _ in range(data.draw(st.integers(1, 8))):
        blob[data.draw(st.integers(0, limit - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(blob))))
    path = folder / "fuzzed.so"
    path.write_bytes(bytes(blob[:cut] if cut is not None else blob))
    info = read_elf(path)  # must not raise
    assert info is None or isinstance(info, ElfInfo)
    problems = check_native_files([path], machine="x86_64", glibc=(2, 36), glibcxx=(3, 4, 30))
    assert all(isinstance(p, str) and p.startswith("fuzzed.so ") for p in problems)


# --- helpers ----------------------------------------------------------------------------------


def test_find_native_files(tmp_path):
    for rel in ["_ops.so", "sub/_impl.so", "libfoo.so.1", "mod.py", "notes.sonic", "sub/x.pyc"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    (tmp_path / "dir.so").mkdir()
    assert find_native_files(tmp_path) == [
        tmp_path / "_ops.so",
        tmp_path / "libfoo.so.1",
        tmp_path / "sub" / "_impl.so",
    ]


@pytest.mark.parametrize(
    "given_name,normal",
    [
        ("x86_64", "x86_64"),
        ("AMD64", "x86_64"),
        ("arm64", "aarch64"),
        ("aarch64", "aarch64"),
        ("i686", "x86"),
        ("ppc64le", "ppc64le"),
        ("s390x", "s390x"),
    ],
)
def test_normalize_machine(given_name, normal):
    assert normalize_machine(given_name) == normal


def test_system_glibc_format():
    glibc = system_glibc()
    if LINUX and hasattr(os, "confstr") and "glibc" in (os.confstr("CS_GNU_LIBC_VERSION") or ""):
        assert isinstance(glibc, tuple) and len(glibc) == 2 and glibc >= (2, 17)
        assert f"glibc {glibc[0]}.{glibc[1]}" in os.confstr("CS_GNU_LIBC_VERSION")
    else:
        assert glibc is None
