"""Supervising benchmark child processes so that a slow or stuck child is reported, never waited on.

The parent side (`Child`) reads a child's stdout and stderr on threads as they come (a child that
fills a pipe nobody reads would block forever), hands each line to a callback, and on a timeout
asks the child for its Python stack (SIGUSR1, answered by faulthandler) before it kills the child's
whole process group; it then waits a bounded time for the pipes, so a grandchild that left the
group with a copy of them cannot hang the parent either.

The child side (`Watchdog`) names the phase the child is in ("load", "step 1", ...) and, while a
phase runs longer than a period, prints a `progress` line to stderr with where the main thread is
(file:line function, innermost first). `log` prints the parent's timestamped progress lines.

No torch import here: the parent of a run must stay light.
"""

from __future__ import annotations

import collections
import faulthandler
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

_START = time.monotonic()
PROGRESS = "progress "  # child stderr lines the parent echoes as they come


_LOG_LOCK = threading.Lock()


def log(message: str) -> None:
    """Print `message` with the wall clock (UTC) and the seconds since this process started,
    as one whole line: the sweep's worker threads log at once (print writes the text and the
    newline apart, so two lines could interleave into one)."""
    stamp = time.strftime("%H:%M:%S", time.gmtime())
    line = f"[{stamp} +{time.monotonic() - _START:5.0f}s] {message}\n"
    with _LOG_LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()


def git_commit(root) -> str:
    """The commit the checkout at `root` is at (short hash, "+dirty" with uncommitted changes
    to tracked files), or the KERNELS_COMMIT variable where there is no git checkout (a copied
    tree)."""
    git = ["git", "-C", str(root)]
    try:
        head = subprocess.run(
            [*git, "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()  # fmt: skip
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return (
            os.environ.get("KERNELS_COMMIT", "").strip() or "unknown (no git; set KERNELS_COMMIT)"
        )


def run_environment(root) -> str:
    """One line for a benchmark's header: UTC date, GPU, host CPU, the versions of torch,
    transformers, triton, liger-kernel and this package, and the commit at `root`."""
    import torch
    from bench_train import cpu_model, versions

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {gpu}, host {cpu_model()} "
        f"({os.cpu_count()} CPUs), "
        + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in versions().items())
        + f", commit {git_commit(root)}"
    )


def _short(path: str) -> str:
    """The part of a source path that says which package it is in (site-packages/ onwards)."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    parts = path.split(os.sep)
    return os.sep.join(parts[-2:])


def where(thread_id: int | None = None, frames: int = 3) -> str:
    """The innermost `frames` frames of a thread's Python stack (the main thread by default), as
    "file:line function < caller < ...". Empty when the thread is gone."""
    ident = thread_id if thread_id is not None else threading.main_thread().ident
    frame = sys._current_frames().get(ident)
    out = []
    while frame is not None and len(out) < frames:
        code = frame.f_code
        out.append(f"{_short(code.co_filename)}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " < ".join(out)


class Watchdog:
    """The child side: `phase(name)` starts a named phase; a daemon thread prints
    `progress <phase> +<s>s at <where>` every `period_s` while one phase lasts, and SIGUSR1 makes
    faulthandler dump every thread's stack to stderr (the parent sends it before a kill)."""

    def __init__(self, label: str, period_s: float = 30.0) -> None:
        self.label = label
        self.period_s = period_s
        self._phase = ""
        self._since = time.monotonic()
        self._lock = threading.Lock()
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        if period_s > 0:
            threading.Thread(target=self._run, name="bench-watchdog", daemon=True).start()

    def phase(self, name: str) -> None:
        with self._lock:
            self._phase, self._since = name, time.monotonic()

    def say(self, message: str) -> None:
        """A progress line the parent echoes with its timestamp."""
        print(f"{PROGRESS}{self.label}: {message}", file=sys.stderr, flush=True)

    def _run(self) -> None:
        while True:
            time.sleep(self.period_s)
            with self._lock:
                name, since = self._phase, self._since
            elapsed = time.monotonic() - since
            if name and elapsed >= self.period_s:
                self.say(f"still in {name} after {elapsed:.0f} s, at {where()}")


# faulthandler's dump: "Current thread 0x... (most recent call first):" or "Thread 0x... (...)",
# then '  File "path", line N in func' lines, innermost first. The header is searched, not
# matched: the signal may come while the child has half a line on stderr (a progress bar
# redrawn with "\r"), and the header then ends that line.
_THREAD = re.compile(r"(Current thread|Thread) 0x[0-9a-f]+ .*\(most recent call first\):$")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')


def stack_from_dump(lines: list[str], frames: int = 3) -> str:
    """The innermost frames of the main thread in a faulthandler dump, as `where` formats them:
    the thread whose outermost frame is a module's top level (a signal may be handled on any
    thread, so "Current thread" need not be the main one); empty if there is no dump."""
    blocks: list[list[tuple[str, str]]] = []
    for line in lines:
        if _THREAD.search(line):
            blocks.append([])
            continue
        m = _FRAME.match(line)
        if m and blocks:
            blocks[-1].append((f"{_short(m['file'])}:{m['line']} {m['func']}", m["func"]))
    blocks = [b for b in blocks if b]
    if not blocks:
        return ""
    main = next((b for b in blocks if b[-1][1] == "<module>"), blocks[0])
    return " < ".join(text for text, _ in main[:frames])


class Child:
    """A child process in its own session, its output read line by line on two threads.

    `on_stdout` and `on_stderr` get each line (without the newline) as it comes; the last
    `keep` stderr lines stay in `tail`. `wait(timeout)` returns the exit code or None when the
    timeout passed; `kill()` then gets the child's stack and kills its process group."""

    def __init__(
        self,
        cmd: list[str],
        env: dict[str, str] | None = None,
        on_stdout: Callable[[str], None] | None = None,
        on_stderr: Callable[[str], None] | None = None,
        stdin: bool = False,
        keep: int = 80,
    ) -> None:
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
            start_new_session=True,
        )  # fmt: skip
        self.tail: collections.deque[str] = collections.deque(maxlen=keep)
        self._dump: list[str] = []
        self._collect_dump = False
        self.state_at_kill = ""  # set by kill() when the child gave no stack
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, on_stdout), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, on_stderr), daemon=True),
        ]
        for t in self._readers:
            t.start()

    def _read(self, pipe, callback) -> None:
        for raw in pipe:
            line = raw.rstrip("\n")
            if pipe is self.proc.stderr:
                self.tail.append(line)
                if self._collect_dump:
                    self._dump.append(line)
            if callback is not None:
                try:
                    callback(line)
                except Exception as exc:  # noqa: BLE001 - a bad line must not stop the reading
                    print(f"bench_supervise: callback failed on {line[:80]!r}: {exc}", flush=True)

    def send(self, line: str) -> None:
        """Write one line to the child's stdin (started with stdin=True)."""
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait(self, timeout: float | None) -> int | None:
        """The exit code once the child exited and its output was read; None after `timeout`."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self._join(10.0)
        return code

    def _await_frame(self, seconds: float) -> bool:
        """Whether a frame line of a dump came within `seconds`."""
        end = time.monotonic() + seconds
        while not any(_FRAME.match(x) for x in self._dump):
            if time.monotonic() >= end:
                return False
            time.sleep(0.1)
        return True

    def _await_quiet(self, seconds: float) -> None:
        """Return once no dump line came for `seconds` (at most 10 s in all)."""
        end = time.monotonic() + 10
        seen = -1
        while seen != len(self._dump) and time.monotonic() < end:
            seen = len(self._dump)
            time.sleep(seconds)

    def _join(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for t in self._readers:
            t.join(max(0.0, deadline - time.monotonic()))

    def kill(self, dump_wait_s: float = 5.0) -> str:
        """Ask the child for its stack (SIGUSR1), kill its process group, and return the
        innermost frames of the dump ("" when the child gave none in `dump_wait_s`; then
        `state_at_kill` holds its scheduler state, "D (disk sleep)" say, where Linux tells)."""
        self._collect_dump = True
        self.state_at_kill = ""
        if self.proc.poll() is None and hasattr(signal, "SIGUSR1") and dump_wait_s > 0:
            # a second signal if the first brought no frame: once seen, a CI run's child gave
            # no dump to one SIGUSR1 in 5 s, and the cause could not be reproduced
            for wait_s in (dump_wait_s / 2, dump_wait_s / 2):
                try:
                    self.proc.send_signal(signal.SIGUSR1)
                except ProcessLookupError:
                    break
                if self._await_frame(wait_s):
                    break
            self._await_quiet(0.5)  # faulthandler writes the dump in one go: let the rest arrive
            if not self._await_frame(0):
                self.state_at_kill = _proc_state(self.proc.pid) or "unknown"
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._join(5.0)  # bounded: a grandchild outside the group may hold the pipes
        return stack_from_dump(list(self._dump))


def where_stuck(stack: str, child: Child) -> str:
    """The end of a kill's reason: where the child was (`kill()`'s stack), or that it gave no
    stack and its process state."""
    return f"stuck at {stack}" if stack else f"no stack dump (process state: {child.state_at_kill})"


def _proc_state(pid: int) -> str:
    """The State line of /proc/<pid>/status ("R (running)", "D (disk sleep)"...); "" where
    there is none."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
