"""Run the reliability suite (tests/reliability) and print what it measured as a Markdown table.

    python scripts/soak.py              soak counts (KERNELS_SOAK=1: 50 kills, thousands of fuzz
                                        cases, the tests marked slow)
    python scripts/soak.py --ci         the counts CI runs
    python scripts/soak.py -- -k crash  anything after `--` goes to pytest

Every test appends rows {what, tried, details} to a JSON-lines file; a row counts as held when
its test passed. A failed test is listed as such and makes the exit status non-zero. The table
is what docs/reliability.md shows, with the date, the machine and the versions above it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = []
    for name in ("torch", "huggingface_hub", "hypothesis"):
        try:
            from importlib.metadata import version

            versions.append(f"{name} {version(name)}")
        except Exception:  # noqa: BLE001 - a missing package is just not listed
            continue
    return (
        f"{os.cpu_count()} CPU cores ({cpu}), {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, " + ", ".join(versions)
    )


def _outcomes(junit: Path) -> dict[str, str]:
    """pytest node id -> 'passed' | 'failed' | 'skipped' | 'xfailed'."""
    out = {}
    for case in ET.parse(junit).iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        node = f"{path}.py::{case.get('name')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds or "error" in kinds:
            out[node] = "failed"
        elif "skipped" in kinds:
            message = next(c for c in case if c.tag == "skipped").get("type", "")
            out[node] = "xfailed" if "xfail" in message else "skipped"
        else:
            out[node] = "passed"
    return out


def table(rows: list[dict], outcomes: dict[str, str]) -> tuple[str, bool]:
    """The Markdown table, and whether every row held."""
    grouped: dict[str, dict] = defaultdict(lambda: {"tried": 0, "held": 0, "failed": 0})
    order: list[str] = []
    for row in rows:
        what = row["what"]
        if what not in grouped:
            order.append(what)
        group = grouped[what]
        group["tried"] += row["tried"]
        if outcomes.get(row["node"], "passed") == "failed":
            group["failed"] += row["tried"]
        else:
            group["held"] += row["tried"]
    lines = ["| tried | times | held | data lost |", "|---|---:|---:|---:|"]
    ok = True
    for what in order:
        group = grouped[what]
        lost = "zero" if not group["failed"] else f"TEST FAILED ({group['failed']})"
        ok &= not group["failed"]
        lines.append(f"| {what} | {group['tried']} | {group['held']} | {lost} |")
    return "\n".join(lines), ok


def details(rows: list[dict]) -> str:
    """Per-row figures (fault counts, timings, outcomes), as a list."""
    out = []
    for row in rows:
        if row["details"]:
            figures = ", ".join(f"{k}={v}" for k, v in row["details"].items())
            out.append(f"- {row['what']}: {figures}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ci", action="store_true", help="the CI counts instead of a soak")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kernels-soak-") as tmp:
        report, junit = Path(tmp) / "report.jsonl", Path(tmp) / "junit.xml"
        env = dict(os.environ, KERNELS_RELIABILITY_REPORT=str(report))
        env.pop("KERNELS_SOAK", None)
        if not args.ci:
            env["KERNELS_SOAK"] = "1"
        start = time.monotonic()
        cmd = [sys.executable, "-m", "pytest", "tests/reliability", "-q", "-p", "no:cacheprovider",
               f"--junitxml={junit}", *args.pytest_args]  # fmt: skip
        status = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        wall = time.monotonic() - start
        rows = (
            [json.loads(line) for line in report.read_text().splitlines()]
            if report.exists()
            else []
        )
        outcomes = _outcomes(junit) if junit.exists() else {}
    mode = "CI counts" if args.ci else "soak (KERNELS_SOAK=1)"
    print(f"\n## Reliability run: {mode}, {time.strftime('%Y-%m-%d')}\n")
    print(f"Machine: {_machine()}. Wall time {wall / 60:.1f} min.\n")
    counts = defaultdict(int)
    for outcome in outcomes.values():
        counts[outcome] += 1
    print("Tests: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + ".\n")
    text, ok = table(rows, outcomes)
    print(text)
    failed = sorted(node for node, outcome in outcomes.items() if outcome == "failed")
    if failed:
        print("\nFAILED: " + ", ".join(failed))
    print("\nFigures:\n")
    print(details(rows))
    return 0 if status == 0 and ok else 1


if __name__ == "__main__":
    sys.exit(main())
