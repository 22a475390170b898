"""Run Liger-Kernel's own test files against this package's kernels, with a log of first calls.

    python scripts/liger_tests.py --liger-src PATH --out DIR [--files rope,swiglu,geglu,layer_norm] [-- PYTEST_ARGS]

PATH is a Liger-Kernel checkout (the folder holding `test/`); nothing of it is copied into this
repository: its `test/__init__.py`, `test/conftest.py`, `test/utils.py` and the chosen
`test/transformers/test_<name>.py` files are copied into a temporary folder for the run, and
pytest runs there with the plugin `liger_tests_plugin` (next to this script), which puts this
package's kernels where the tests call Liger's (the installed liger-kernel stays the reference
for what is not replaced; see the plugin's docstring for the table).

Writes to DIR: `junit.xml`, `pytest.txt` (pytest's -rA output), `tests.jsonl` (per test: outcome,
duration, which of our entry points it called, Triton compiles during it) and `summary.md` (the
counts, the slowest tests and first calls, the tests that ran no kernel of ours).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = ("rope", "swiglu", "geglu", "layer_norm")
SUPPORT = ("__init__.py", "conftest.py", "utils.py")


def stage(liger_src: Path, files: list[str], into: Path) -> list[Path]:
    """Copy Liger's test support files and the chosen test files under `into`/test."""
    src = liger_src / "test"
    if not (src / "transformers").is_dir():
        raise SystemExit(f"{liger_src}: no test/transformers folder; pass a Liger-Kernel checkout")
    (into / "test" / "transformers").mkdir(parents=True)
    for name in SUPPORT:
        if (src / name).exists():
            shutil.copy(src / name, into / "test" / name)
    (into / "test" / "transformers" / "__init__.py").touch()
    tests = []
    for name in files:
        path = src / "transformers" / f"test_{name}.py"
        if not path.exists():
            raise SystemExit(f"{path} does not exist")
        shutil.copy(path, into / "test" / "transformers" / path.name)
        tests.append(into / "test" / "transformers" / path.name)
    return tests


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--liger-src", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--files", default=",".join(FILES))
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="liger-tests-") as tmp:
        tests = stage(args.liger_src.resolve(), args.files.split(","), Path(tmp))
        env = dict(os.environ, LIGER_TESTS_OUT=str(args.out))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "pytest", "-p", "liger_tests_plugin", "-p", "no:cacheprovider",
               "-rA", f"--junitxml={args.out / 'junit.xml'}", f"--rootdir={tmp}",
               *map(str, tests), *extra]  # fmt: skip
        with open(args.out / "pytest.txt", "w") as log:
            run = subprocess.run(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
    summary = args.out / "summary.md"
    if summary.exists():
        print(summary.read_text())
    print(f"pytest exit {run.returncode}; output in {args.out / 'pytest.txt'}")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
