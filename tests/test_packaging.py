"""Packaging: the loader/ and cache/ mapping, the wheel's contents, import cost."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def _declared_packages() -> list[str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data["tool"]["setuptools"]["packages"]


def test_package_list_matches_the_folders():
    found = {"kernels", "kernels.cache"}
    for init in (ROOT / "loader").rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT / "loader")
        if "__pycache__" not in rel.parts and rel.parts:
            found.add("kernels." + ".".join(rel.parts))
    for init in (ROOT / "cache").rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT / "cache")
        if rel.parts:
            found.add("kernels.cache." + ".".join(rel.parts))
    assert sorted(_declared_packages()) == sorted(found)


def test_wheel_holds_both_packages_and_the_version(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    wheel = next(tmp_path.glob("kernels-0.18.*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "kernels/__init__.py" in names
    assert "kernels/cache/__init__.py" in names
    assert "kernels/cli/main.py" in names
    assert not any(n.startswith(("loader/", "cache/", "tests/", "hub_kernels/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kernels = kernels.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_import_kernels_is_light():
    code = (
        "import sys, time; t = time.perf_counter(); import kernels; dt = time.perf_counter() - t;"
        "bad = [m for m in ('torch', 'huggingface_hub', 'httpx', 'httpx2') if m in sys.modules];"
        "print(bad, dt)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    bad, seconds = out.stdout.rsplit(" ", 1)
    assert bad == "[]", out.stdout
    assert float(seconds) < 0.5  # measured ~5 ms; generous for a loaded CI machine


def test_version_is_in_the_transformers_window():
    import kernels
    from packaging.version import Version

    assert Version("0.18.2") <= Version(kernels.__version__) < Version("0.19")


def test_the_wheel_works_without_this_checkout(tmp_path):
    """docs/install.md's promise: a wheel built here runs where the checkout is not."""
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(wheels), str(ROOT)],
        check=True,
        capture_output=True,
    )
    target = tmp_path / "site"
    wheel = next(wheels.glob("kernels-0.18.*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target)]
        + [str(wheel)],
        check=True,
        capture_output=True,
    )
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(target), "HOME": str(tmp_path)}

    def run(*args: str) -> str:
        out = subprocess.run(args, cwd=away, env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout

    where = run(sys.executable, "-c", "import kernels; print(kernels.__file__)")
    assert where.startswith(str(target)), where  # the wheel's copy, not the checkout's
    assert run(str(target / "bin" / "kernels"), "--version").startswith("kernels 0.18.")
    assert "mirror" in run(sys.executable, "-m", "kernels", "--help")
