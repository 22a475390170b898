"""scripts/bench_supervise.py and bench_train.run_setup: a stuck benchmark child is killed on time
and reported with the phase it was in and where its main thread was, even when a process it
started left its process group holding the output pipes (real processes and signals)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_supervise  # noqa: E402
import bench_train  # noqa: E402

# A setup child that starts a grandchild in a session of its own (so killing the child's
# process group misses it) which inherits the child's stdout and stderr, says one progress
# line, and then hangs in a function of its own.
STUCK_CHILD = """
import subprocess, sys, time
sys.path.insert(0, {scripts!r})
import bench_supervise
watch = bench_supervise.Watchdog("probe", period_s=0.5)
holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                          start_new_session=True)
open({pidfile!r}, "w").write(str(holder.pid))
watch.say("loaded in 0.1 s")

def stuck_in_the_first_step():
    watch.phase("step 1")
    time.sleep(300)

stuck_in_the_first_step()
"""


@pytest.fixture
def pidfile(tmp_path):
    path = tmp_path / "holder.pid"
    yield path
    if path.exists():  # the grandchild outlives the kill by design: end it here
        try:
            os.kill(int(path.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def test_a_stuck_setup_is_killed_on_time_and_says_where_it_was(pidfile):
    code = STUCK_CHILD.format(scripts=str(SCRIPTS), pidfile=str(pidfile))
    rows: list[dict] = []
    runner = threading.Thread(
        target=lambda: rows.append(
            bench_train.run_setup("probe", [sys.executable, "-c", code], dict(os.environ), 4.0)
        ),
        daemon=True,
    )
    t0 = time.monotonic()
    runner.start()
    runner.join(60)
    # the grandchild keeps the pipes open for 300 s: waiting for their end would hang here
    assert not runner.is_alive(), "run_setup did not return after the setup's timeout"
    assert time.monotonic() - t0 < 40
    (row,) = rows
    assert row["setup"] == "probe"
    error = row["error"]
    assert error.startswith("killed after 4 s (last progress: ")
    assert "still in step 1 after" in error or "loaded in 0.1 s" in error
    # the stack faulthandler dumped on SIGUSR1: the main thread, innermost frame first
    assert "stuck at <string>:" in error and "stuck_in_the_first_step" in error, error
    assert "\n" not in error


def test_the_dump_is_read_from_the_main_thread_whichever_thread_handled_the_signal():
    dump = [
        "Current thread 0x00007f01 (most recent call first):",
        '  File "/usr/lib/python3.12/threading.py", line 359 in wait',
        '  File "/x/scripts/bench_supervise.py", line 90 in _run',
        '  File "/usr/lib/python3.12/threading.py", line 1012 in run',
        "",
        "Thread 0x00007f00 (most recent call first):",
        '  File "/v/lib/python3.12/site-packages/liger_kernel/ops/cross_entropy.py", line 50 in f',
        '  File "/v/lib/python3.12/site-packages/torch/autograd/function.py", line 575 in apply',
        '  File "/w/scripts/bench_train.py", line 380 in child',
        '  File "/w/scripts/bench_train.py", line 700 in <module>',
    ]
    assert bench_supervise.stack_from_dump(dump) == (
        "liger_kernel/ops/cross_entropy.py:50 f < torch/autograd/function.py:575 apply"
        " < scripts/bench_train.py:380 child"
    )
    assert bench_supervise.stack_from_dump(["no dump here"]) == ""


def test_a_header_that_ends_a_half_written_line_still_starts_the_dump():
    """The signal can come while the child has half a line on stderr (a progress bar redrawn
    with a carriage return): the header then ends that line, and the dump must still parse."""
    dump = [
        "Loading weights:  45%|####5     | 9/20 Current thread 0x00007f00 (most recent call first):",
        '  File "/w/scripts/sweep_models.py", line 88 in run_type',
        '  File "/w/scripts/sweep_models.py", line 131 in worker',
        '  File "/w/scripts/sweep_models.py", line 540 in <module>',
    ]
    assert bench_supervise.stack_from_dump(dump) == (
        "scripts/sweep_models.py:88 run_type < scripts/sweep_models.py:131 worker"
        " < scripts/sweep_models.py:540 <module>"
    )
    assert bench_supervise.stack_from_dump(["Thread 0x00007f00 is not a header"]) == ""


# A child whose first SIGUSR1 only installs faulthandler's dumper: it answers the second one.
DEAF_TO_THE_FIRST_SIGNAL = """
import faulthandler, signal, sys, time
signal.signal(signal.SIGUSR1, lambda *_: faulthandler.register(signal.SIGUSR1, all_threads=True))
print("ready", flush=True)

def waiting_for_the_second_signal():
    while True:
        time.sleep(0.05)

waiting_for_the_second_signal()
"""


def test_a_child_that_gives_no_dump_to_the_first_signal_is_asked_again():
    ready = threading.Event()
    child = bench_supervise.Child(
        [sys.executable, "-c", DEAF_TO_THE_FIRST_SIGNAL],
        on_stdout=lambda line: line == "ready" and ready.set(),
    )
    assert ready.wait(60), list(child.tail)
    stack = child.kill(dump_wait_s=4.0)
    assert stack.startswith("<string>:"), (stack, list(child.tail))
    assert "waiting_for_the_second_signal" in stack
    assert child.state_at_kill == ""
    assert child.proc.returncode == -signal.SIGKILL


def test_a_child_that_never_dumps_is_killed_and_its_state_is_said():
    ready = threading.Event()
    child = bench_supervise.Child(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN);"
         " print('ready', flush=True); time.sleep(300)"],
        on_stdout=lambda line: line == "ready" and ready.set(),
    )  # fmt: skip
    assert ready.wait(60), list(child.tail)
    t0 = time.monotonic()
    assert child.kill(dump_wait_s=1.0) == ""
    assert time.monotonic() - t0 < 15
    assert child.proc.returncode == -signal.SIGKILL
    if Path("/proc/self/status").exists():
        assert child.state_at_kill.startswith("S"), child.state_at_kill  # sleeping in time.sleep
