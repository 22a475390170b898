"""`kernels serve DIR` as a process: the serving line, signals, bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import pytest
from kernels.serve import GitRepoWriter

SERVING = re.compile(r"^serving (?P<dir>.+) on (?P<url>http://\S+)$")
TOKEN = "serve-cli-test-token"


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kernels.serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "KERNELS_SERVE_TOKEN": TOKEN},  # opens the request log over HTTP
    )


def serving_url(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline().rstrip("\n")
    match = SERVING.match(line)
    assert match, (
        f"unexpected first line {line!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
    )
    return match["url"]


def get_json(url: str, headers: dict | None = None):
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_serves_and_stops_on_signal(tmp_path, sig):
    sha = GitRepoWriter(tmp_path / "org" / "relu").commit({"a.txt": "a"})
    proc = start(str(tmp_path), "--port", "0")
    try:
        url = serving_url(proc)
        assert url.startswith("http://127.0.0.1:")
        refs = get_json(f"{url}/api/kernels/org/relu/refs")
        assert refs["branches"] == [{"name": "main", "ref": "refs/heads/main", "targetCommit": sha}]
        log = get_json(f"{url}/_mirror/requests", {"X-Mirror-Token": TOKEN})
        assert log["count"] == 1
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()
    assert proc.stderr.read() == ""


# `kernels serve` in the main thread of a process that raises SIGTERM in itself at the worst
# moment it can: once serving, right after its main thread has taken a lock (a profile hook
# sees the C `acquire` return). Python runs the handler at the next bytecode, that lock held.
SIGNAL_WHILE_HOLDING_A_LOCK = """
import signal, sys
from kernels.serve.cli import main

serving = []
write = sys.stdout.write
sys.stdout.write = lambda text: (serving.append(text.startswith("serving ")), write(text))[1]

def hook(frame, event, arg):
    taken = event == "c_return" and getattr(arg, "__name__", "") in ("acquire", "__enter__")
    if taken and any(serving):
        sys.setprofile(None)
        signal.raise_signal(signal.SIGTERM)

sys.setprofile(hook)
sys.exit(main([sys.argv[1], "--port", "0"]))
"""


def test_a_signal_that_lands_while_the_main_loop_holds_a_lock_still_stops_the_server(tmp_path):
    """A handler that set a threading.Event the main loop waited on deadlocked here (the
    handler blocks on the Event's lock, held by the thread it interrupted): the server never
    stopped, as a CI run once saw. Where the loop takes no lock, the signal comes from here."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGNAL_WHILE_HOLDING_A_LOCK, str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert SERVING.match(proc.stdout.readline().rstrip("\n"))
        try:
            code = proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=10)
        assert code == 0
    finally:
        proc.kill()
        proc.wait()


def test_cli_line_names_the_resolved_dir(tmp_path):
    proc = start(str(tmp_path), "--port", "0", "--no-lfs-redirect")
    try:
        line = proc.stdout.readline()
        assert SERVING.match(line.rstrip("\n"))["dir"] == str(tmp_path.resolve())
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


@pytest.mark.parametrize("make", ["missing", "file"])
def test_cli_bad_dir_is_one_line_and_exit_2(tmp_path, make):
    target = tmp_path / "x"
    if make == "file":
        target.write_text("not a dir")
    proc = subprocess.run(
        [sys.executable, "-m", "kernels.serve", str(target), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    error, hint = proc.stderr.splitlines()
    assert error.startswith("error: ") and "is not a readable directory" in error
    assert hint.startswith("hint: ") and "kernels mirror build" in hint


def test_cli_bad_config_is_refused(tmp_path):
    (tmp_path / "kernels-mirror.toml").write_text("trusted_publishers = [1, 2]\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kernels.serve", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "trusted_publishers" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_warns_when_not_loopback(tmp_path):
    proc = start(str(tmp_path), "--host", "0.0.0.0", "--port", "0")
    try:
        assert serving_url(proc).startswith("http://0.0.0.0:")
        proc.terminate()
        assert proc.wait(timeout=10) == 0
        assert "not loopback" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_main_parses_the_documented_flags():
    from kernels.serve.cli import _parser

    args = _parser().parse_args(["DIR", "--host", "::1", "--port", "0", "--no-lfs-redirect"])
    assert (args.dir, args.host, args.port, args.no_lfs_redirect) == ("DIR", "::1", 0, True)
    assert _parser().prog == "kernels serve"


def test_the_package_needs_no_hub_client_or_torch():
    code = "import sys, kernels.serve; print(sorted(m for m in ('torch', 'huggingface_hub') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _stderr_after_stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    assert proc.wait(timeout=10) == 0
    return proc.stderr.read()


STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ "


def test_cli_warns_when_dir_holds_no_repos(tmp_path):
    proc = start(str(tmp_path), "--port", "0")
    try:
        serving_url(proc)
        err = _stderr_after_stop(proc)
    finally:
        proc.kill()
        proc.wait()
    assert re.fullmatch(STAMP + r"warning: .* holds no repos .*\n", err), err


def test_cli_tells_a_hub_layout_folder_to_be_built_first(tmp_path):
    (tmp_path / "org" / "relu" / "build" / "torch-universal").mkdir(parents=True)
    proc = start(str(tmp_path), "--port", "0")
    try:
        serving_url(proc)
        err = _stderr_after_stop(proc)
    finally:
        proc.kill()
        proc.wait()
    assert "Hub layout" in err and f"kernels mirror build {tmp_path} DEST" in err


def test_cli_port_in_use_suggests_port_0(tmp_path):
    GitRepoWriter(tmp_path / "org" / "relu").commit({"a.txt": "a"})
    first = start(str(tmp_path), "--port", "0")
    try:
        port = serving_url(first).rsplit(":", 1)[1]
        out = subprocess.run(
            [sys.executable, "-m", "kernels", "serve", str(tmp_path), "--port", port],
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        first.terminate()
        first.wait(timeout=10)
    assert out.returncode == 1
    error, hint = out.stderr.splitlines()
    assert error.startswith(f"error: cannot serve on 127.0.0.1:{port}: ")
    assert hint == "hint: another server holds that port: pass --port 0 to pick a free one"


def test_cli_access_log_has_timestamps_and_help_hides_faults(tmp_path):
    GitRepoWriter(tmp_path / "org" / "relu").commit({"a.txt": "a"})
    proc = start(str(tmp_path), "--port", "0", "-v")
    try:
        url = serving_url(proc)
        get_json(f"{url}/api/kernels/org/relu/refs")
        err = _stderr_after_stop(proc)
    finally:
        proc.kill()
        proc.wait()
    assert re.match(STAMP + r"127\.0\.0\.1 - .*GET /api/kernels/org/relu/refs", err), err
    help_text = subprocess.run(
        [sys.executable, "-m", "kernels", "serve", "--help"], capture_output=True, text=True
    ).stdout
    assert "--faults" not in help_text and "--port" in help_text


def test_mirror_build_command_then_serve(tmp_path):
    from pathlib import Path

    hub_kernels = Path(__file__).resolve().parents[2] / "hub_kernels"
    dest = tmp_path / "mirror"
    build = subprocess.run(
        [sys.executable, "-m", "kernels", "mirror", "build", str(hub_kernels), str(dest), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert build.returncode == 0, build.stderr
    repos = json.loads(build.stdout)["repos"]
    assert {r["repo_id"] for r in repos} == {"kernels-lab/activation", "kernels-lab/training"}
    proc = start(str(dest), "--port", "0")
    try:
        url = serving_url(proc)
        refs = get_json(f"{url}/api/kernels/kernels-lab/activation/refs")
        assert {b["name"] for b in refs["branches"]} == {"main", "v1"}
        assert _stderr_after_stop(proc) == ""  # repos found: no warning
    finally:
        proc.kill()
        proc.wait()
    empty = tmp_path / "empty"
    empty.mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "kernels", "mirror", "build", str(empty), str(dest)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "holds no kernel folders" in out.stderr
