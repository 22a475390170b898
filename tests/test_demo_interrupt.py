"""Ctrl-C in the demo (issue 31): one line on stderr, no traceback, the mirror server stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "after", ["serving ", "cold load:"], ids=["mirror-up", "during-the-warm-load"]
)
def test_ctrl_c_in_the_demo_prints_one_line(tmp_path, after):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "KERNELS_"))}
    demo = subprocess.Popen(
        [sys.executable, "scripts/demo.py", "--keep", str(tmp_path / "work")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        # and Ctrl-C's default action, as a terminal gives it: a shell running these tests in
        # the background (`cmd &` without job control) hands its children SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        for line in demo.stdout:
            if line.startswith(after):  # the demo is mid-way (then a child of it may be running)
                break
        os.killpg(demo.pid, signal.SIGINT)  # what Ctrl-C sends: the whole group
        _, stderr = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    assert demo.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines() == ["demo: interrupted"], stderr
