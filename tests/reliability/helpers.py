"""Helpers for the reliability suite: trial counts, fixture kernels, cache checks, the CLI, figures.

KERNELS_SOAK=1 raises every trial count (and runs the tests marked slow); CI runs the small
counts. KERNELS_RELIABILITY_REPORT=<file> makes tests append their measured figures as JSON
lines, which scripts/soak.py turns into the table in docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from kernels.cache import Cache

from tests.kernel_repos import metadata

# Read at import: the root conftest clears KERNELS_* variables for each test.
SOAK = os.environ.get("KERNELS_SOAK", "").strip() not in ("", "0")
REPORT = os.environ.get("KERNELS_RELIABILITY_REPORT")

# For tests that only a soak run makes: `@pytest.mark.slow` plus this.
soak_only = pytest.mark.skipif(not SOAK, reason="soak run only: set KERNELS_SOAK=1")


def trials(ci: int, soak: int) -> int:
    """How many trials to run: `ci` normally, `soak` under KERNELS_SOAK=1."""
    return soak if SOAK else ci


def fuzz(ci: int = 300, soak: int = 5000):
    """Hypothesis settings for a fuzz test: `ci` examples normally, `soak` under KERNELS_SOAK=1."""
    return settings(
        max_examples=trials(ci, soak),
        deadline=None,
        database=None,
        derandomize=not SOAK,  # CI runs the same cases every time; a soak explores new ones
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def record(what: str, tried: int, **details) -> None:
    """Append one measured row to $KERNELS_RELIABILITY_REPORT (when set): `what` was tried
    `tried` times in the test now running. scripts/soak.py adds up rows with the same `what` and
    marks them held (test passed) or not."""
    if not REPORT:
        return
    node = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    row = {"what": what, "tried": tried, "node": node, "soak": SOAK, "details": details}
    with open(REPORT, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row, sort_keys=True) + "\n")


# -- fixture kernels (pure Python: importing torch in 32 processes would dominate the run) ------


def pure_kernel(
    name: str,
    *,
    value: int = 1,
    variant: str = "torch-universal",
    lfs: dict[str, bytes] | None = None,
    plain: dict[str, bytes] | None = None,
    writer=None,
    init_code: str = "",
    meta: dict | None = None,
) -> dict[str, str | bytes]:
    """Files of a kernel repo whose module has VALUE = value and `digests()` of its data files.

    `lfs` files are stored as git-lfs objects of `writer`'s repo; `plain` files as git blobs.
    `init_code` runs at import (e.g. to write a marker file); `meta` adds metadata.json fields.
    """
    base = f"build/{variant}"
    data_names = sorted({*(lfs or {}), *(plain or {})})
    files: dict[str, str | bytes] = {
        f"{base}/metadata.json": metadata(name, **(meta or {})),
        f"{base}/__init__.py": textwrap.dedent(
            f"""\
            import hashlib
            import pathlib

            VALUE = {value}
            DATA = {data_names!r}
            {init_code}

            def digests():
                here = pathlib.Path(__file__).parent
                return {{n: hashlib.sha256((here / n).read_bytes()).hexdigest() for n in DATA}}
            """
        ),
        f"{base}/_impl.py": "def double(x):\n    return 2 * x\n",
        "README.md": f"# {name}\n",
    }
    for rel, data in (plain or {}).items():
        files[f"{base}/{rel}"] = data
    for rel, data in (lfs or {}).items():
        assert writer is not None, "LFS files need the repo's writer"
        files[f"{base}/{rel}"] = writer.lfs(data)
    return files


def payload(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- the cache's invariants ------------------------------------------------------------------

CONTENT_BUCKETS = ("objects", "aliases", "trees", "manifests", "index")


def cache_problems(root: Path | str) -> list[str]:
    """Everything wrong with a cache, by its own rules (empty when sound).

    Every object's bytes hash to its name, every alias points at a stored object with that git
    blob id, every tree on disk is complete and matches its manifest, every installed variant
    has its manifest and a verified tree. A cache that was never written is sound.
    """
    cache = Cache(root)
    problems: list[str] = []
    for digest in cache.objects.iter_digests():
        if not cache.objects.verify(digest):
            problems.append(f"object {digest} does not hash to its name")
    alias_dir = cache.base / "aliases" / "git-sha1"
    if alias_dir.is_dir():
        for alias in alias_dir.iterdir():
            if alias.name.startswith(".tmp-"):
                problems.append(f"alias temp file left: {alias.name}")
                continue
            target = alias.read_text().strip()
            path = cache.objects.path(target)
            if not path.is_file():
                problems.append(f"alias {alias.name} -> missing object {target}")
                continue
            data = path.read_bytes()
            blob = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
            if blob != alias.name:
                problems.append(f"alias {alias.name} -> object with git id {blob}")
    for digest in cache.trees.iter_digests():
        manifest = cache.index.get_manifest(digest)
        if manifest is None:
            problems.append(f"tree {digest} has no manifest")
            continue
        check = cache.trees.check(manifest, full=True)
        if not check.ok:
            problems.append(f"tree {digest} does not match its manifest: {check.bad}")
        tree = cache.trees.path(digest)
        on_disk = {p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()}
        extra = on_disk - {e.path for e in manifest.files}
        if extra:
            problems.append(f"tree {digest} has files not in its manifest: {sorted(extra)}")
    for repo, commit, variant, check in cache.verify_all(full=True):
        if not check.ok:
            problems.append(f"installed {repo}@{commit[:12]}/{variant} is broken: {check.bad}")
    return problems


def tmp_leftovers(root: Path | str) -> list[str]:
    """Files under tmp/ (staging folders of live processes are empty between operations;
    their `.lock` files are ownership marks, not data)."""
    tmp = Cache(root).tmp
    if not tmp.is_dir():
        return []
    return sorted(
        p.relative_to(tmp).as_posix()
        for p in tmp.rglob("*")
        if not p.is_dir() and not p.name.endswith(".lock")
    )


def installed_variants(root: Path | str) -> list[tuple[str, str, str]]:
    return [(r, c, v) for r, c, v, _ in Cache(root).index.entries()]


def bucket_snapshot(root: Path | str) -> dict[str, str]:
    """{relative path: sha256} of every file in the content buckets (objects ... index)."""
    base = Cache(root).base
    out = {}
    for bucket in CONTENT_BUCKETS:
        folder = base / bucket
        if not folder.is_dir():
            continue
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                out[path.relative_to(base).as_posix()] = sha256(path.read_bytes())
    return out


# -- processes ---------------------------------------------------------------------------------

# Child processes that only exercise the cache, the network and the locks hide torch (a machine
# without torch, which the loader supports): importing it costs ~3 s of CPU per process, which
# would dominate a CI run of dozens of processes on 2 cores. A soak run (KERNELS_SOAK=1) imports
# it as users do.
_NO_TORCH = "import sys; sys.modules['torch'] = None\n"


def python_argv(code: str, *, hide_torch: bool = not SOAK) -> list[str]:
    """argv for a child interpreter running `code` (torch hidden outside a soak run)."""
    return [sys.executable, "-c", (_NO_TORCH if hide_torch else "") + textwrap.dedent(code)]


def cli_argv(*args: str) -> list[str]:
    """argv for the `kernels` command line (the console script's main) in a child interpreter."""
    return python_argv("import sys\nfrom kernels.cli.main import main\nsys.exit(main())") + list(
        args
    )


def kernels_cli(
    *args: str, env: dict | None = None, timeout: float = 120, **kwargs
) -> subprocess.CompletedProcess:
    """Run the `kernels` command line in a fresh interpreter with this process's environment."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        cli_argv(*args),
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        **kwargs,
    )


def assert_user_error(out: subprocess.CompletedProcess, *needles: str) -> None:
    """The CLI's contract for a user error: exit 1 (2 for a malformed argument, a usage error),
    `error: ...` then `hint: ...`, no traceback."""
    err = out.stderr
    assert out.returncode in (1, 2), (out.returncode, out.stdout, err)
    assert "Traceback" not in err, err
    assert "looks like a bug" not in err, err
    lines = err.strip().splitlines()
    assert lines and lines[0].startswith("error: "), err
    assert any(line.startswith("hint: ") for line in lines), err
    for needle in needles:
        assert needle.lower() in err.lower(), (needle, err)


def wait_for(predicate, timeout: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
