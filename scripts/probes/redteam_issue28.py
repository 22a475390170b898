"""Issue 28's attacks 1-7 (and its reference-CLI and message items), re-run end to end as an
attacker would: real `kernels` command lines in child processes, real HTTP on loopback (`kernels
serve`, or tests/security/hostile.py's server), a second real user (`nobody`, when run as root),
real files in sticky shared folders. Prints one row per attack: OK (the attack fails with a
clear typed error), VULN (the attacker's code or data reached the victim) or BUG (crash, hang,
untyped error, misleading message, cache left half-written); exit 1 when any row is not OK.

    .venv/bin/python scripts/probes/redteam_issue28.py

The variants found beyond these are tests: tests/security/test_redteam_*.py.
"""

from __future__ import annotations

import http.client
import json
import os
import py_compile
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kernels.serve import GitRepoWriter, MirrorServer  # noqa: E402

from tests.kernel_repos import metadata  # noqa: E402
from tests.security.hostile import HostileHub, KernelRepo, Reply  # noqa: E402

IS_ROOT = os.geteuid() == 0
NOBODY = 65534
EVIL = "\x1b[2K\rOK: verified\u202e.py"
RAW = ("\x1b", "\r", "\u202e")
ROWS: list[tuple[str, str, str, str]] = []
WORK = Path(tempfile.mkdtemp(prefix="redteam28-"))
WORK.chmod(0o755)


def as_nobody(action: Callable[[], None]) -> None:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the action as nobody failed"


def env(**changes: str | None) -> dict:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("KERNELS_", "HF_"))}
    out.update(HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1,localhost")
    for k, v in changes.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def fresh(name: str, **changes: str | None) -> dict:
    """An environment with its own cache, HF home and config."""
    base = WORK / name
    base.mkdir(parents=True, exist_ok=True)
    return env(
        KERNELS_CACHE=str(base / "cache"),
        HF_HOME=str(base / "hf"),
        KERNELS_CONFIG=str(base / "config.toml"),
        **changes,
    )


def cli(*args: str, e: dict, timeout: float = 120, cwd: Path | None = None):
    return subprocess.run(
        [sys.executable, "-m", "kernels", *args],
        env=e,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def py(code: str, *args: str, e: dict, timeout: float = 120):
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=e,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def row(item: str, variant: str, outcome: str, detail: str = "") -> None:
    ROWS.append((item, variant, outcome, detail))
    print(f"{outcome:4}  {item:<6} {variant}  {detail}", flush=True)


def attack(item: str, variant: str):
    """Run the decorated function; its return is (outcome, detail); an exception is BUG."""

    def wrap(fn):
        try:
            outcome, detail = fn()
        except subprocess.TimeoutExpired:
            outcome, detail = "BUG", "hung (timed out)"
        except Exception as exc:  # noqa: BLE001 - a broken attack is reported, not hidden
            outcome, detail = "BUG", f"{type(exc).__name__}: {exc}"
        row(item, variant, outcome, detail)
        return fn

    return wrap


def kernel_files(marker: Path, value: int = 1) -> dict[str, str]:
    return {
        "build/torch-universal/metadata.json": metadata("relu"),
        "build/torch-universal/__init__.py": (
            f"open({str(marker)!r}, 'a').write('ran\\n')\nVALUE = {value}\n"
        ),
    }


def hub_dir(name: str, repos: dict[str, dict], trust: list[str]) -> Path:
    root = WORK / name
    for repo_id, files in repos.items():
        GitRepoWriter(root / repo_id).commit(files, branch="v1")
        GitRepoWriter(root / repo_id).commit(files, branch="main")
    names = ", ".join(f'"{o}"' for o in trust)
    (root / "kernels-mirror.toml").write_text(f"trusted_publishers = [{names}]\n")
    return root


# -- 1. mirror build -----------------------------------------------------------------------------


@attack("1", "nobody links the builder's private key into a shared SRC; build, then serve")
def _():
    if not IS_ROOT:
        return "OK", "skipped: needs root"
    shared = WORK / "drop"
    shared.mkdir()
    shared.chmod(0o1777)
    key = WORK / "home" / "id_ed25519"
    key.parent.mkdir(mode=0o700)
    key.write_bytes(b"PRIVATE KEY\n")
    key.chmod(0o600)

    def plant() -> None:
        variant = shared / "src" / "evil" / "relu" / "build" / "torch-universal"
        variant.mkdir(parents=True)
        (variant / "metadata.json").write_text(json.dumps({"version": 1}))
        (variant / "__init__.py").write_text("VALUE = 1\n")
        os.symlink(key, variant / "id_ed25519")  # dangling for nobody, not for the builder

    as_nobody(plant)
    out = cli("mirror", "build", str(shared / "src"), str(WORK / "dest1"), e=env())
    if out.returncode == 0:
        return "VULN", "the build copied the link's target"
    ok = "symbolic link" in out.stderr and not (WORK / "dest1").exists()
    return ("OK" if ok else "BUG"), out.stderr.strip().splitlines()[0]


@attack("1", "SRC's kernels-mirror.toml names whom the mirror trusts")
def _():
    src = WORK / "src-trust"
    variant = src / "evil" / "relu" / "build" / "torch-universal"
    variant.mkdir(parents=True)
    (variant / "metadata.json").write_text(json.dumps({"version": 1}))
    (variant / "__init__.py").write_text("VALUE = 1\n")
    (src / "kernels-mirror.toml").write_text('trusted_publishers = ["evil"]\n')
    out = cli("mirror", "build", str(src), str(WORK / "dest-trust"), e=env())
    with MirrorServer(WORK / "dest-trust") as server:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
        conn.request("GET", "/api/organizations/evil/overview")
        trusted = json.loads(conn.getresponse().read()).get("trustedKernelPublisher")
    if trusted:
        return "VULN", "the mirror trusts the org SRC named"
    return ("OK" if "--trust" in out.stderr else "BUG"), "not trusted; the CLI warned"


# -- 2. snapshots ----------------------------------------------------------------------------------

INSTALL = (
    "import sys, kernels; print(kernels.install_kernel('good-org/kernel', revision=sys.argv[1]))"
)


@attack("2", "install_kernel's path at the Hub, after a mirror serves the same commit")
def _():
    marker = WORK / "snap-ran"
    root = hub_dir("snap-hub", {"good-org/kernel": kernel_files(marker)}, ["good-org"])
    commit = GitRepoWriter(root / "good-org/kernel").head("v1")
    e = fresh("snap")
    with MirrorServer(root) as honest, HostileHub() as mirror:
        bad = kernel_files(WORK / "snap-evil", value=66)
        KernelRepo("good-org/kernel", {p: d.encode() for p, d in bad.items()}, commit).install(
            mirror
        )
        mirror.route(
            r"/api/organizations/[^/]+/overview",
            lambda _s, _m: Reply(200, {}, b'{"trustedKernelPublisher": true}'),
        )
        first = py(INSTALL, commit, e={**e, "HF_ENDPOINT": honest.url})
        second = py(INSTALL, commit, e={**e, "HF_ENDPOINT": mirror.url})
    path = Path(first.stdout.strip())
    if first.returncode or second.returncode:
        return "BUG", (first.stderr + second.stderr).strip().splitlines()[-1]
    shows = (path / "__init__.py").read_text()
    return (
        ("VULN", "the Hub's path now shows the mirror's files")
        if "VALUE = 66" in shows  # the mirror's module (the path in either may hold "66")
        else (
            "OK",
            "the Hub's path still shows the Hub's files",
        )
    )


# -- 3. LOCAL_KERNELS ------------------------------------------------------------------------------

LOAD = (
    "import kernels, kernels.errors\n"
    "try:\n    print(kernels.get_kernel('lab-org/k', version=1).VALUE)\n"
    "except kernels.errors.KernelsError as exc:\n    print(type(exc).__name__)\n"
)


@attack("3", "LOCAL_KERNELS names a folder nobody made in a sticky shared folder")
def _():
    if not IS_ROOT:
        return "OK", "skipped: needs root"
    shared = WORK / "tmp-like"
    shared.mkdir()
    shared.chmod(0o1777)
    marker = shared / "ran"

    def plant() -> None:
        for rel, text in kernel_files(marker, 5).items():
            path = shared / "kernel" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

    as_nobody(plant)
    out = py(LOAD, e=fresh("local", LOCAL_KERNELS=f"lab-org/k={shared / 'kernel'}"))
    if marker.exists():
        return "VULN", "nobody's code ran"
    return ("OK" if out.stdout.strip() == "UnsafePermissions" else "BUG"), out.stdout.strip()


@attack("3", "a relative LOCAL_KERNELS entry from a working directory others can write")
def _():
    marker = WORK / "rel-ran"
    for rel, text in kernel_files(marker, 5).items():
        path = WORK / "relk" / "kernel" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    cwd = WORK / "relk" / "work"
    cwd.mkdir()
    cwd.chmod(0o777)
    out = subprocess.run(
        [sys.executable, "-c", LOAD],
        env=fresh("rel", LOCAL_KERNELS="lab-org/k=../kernel"),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if marker.exists():
        return "VULN", "loaded through a working directory others control"
    return ("OK" if out.stdout.strip() == "UnsafePermissions" else "BUG"), out.stdout.strip()


# -- 4. verify -------------------------------------------------------------------------------------

VERIFY = (
    "import sys; from kernels.verify import verify_digest\n"
    "print(type(verify_digest(sys.argv[1])).__name__)\n"
)


def _digest_variant(folder: Path, files: dict[str, bytes]) -> None:
    import base64
    import hashlib

    folder.mkdir(parents=True)
    for rel, data in files.items():
        (folder / rel).write_bytes(data)
    meta = json.loads(metadata("relu"))
    meta["digest"] = {
        "algorithm": "sha256",
        "files": {
            r: base64.b64encode(hashlib.sha256(d).digest()).decode() for r, d in files.items()
        },
    }
    (folder / "metadata.json").write_text(json.dumps(meta))


@attack("4", "an unchecked-hash .pyc in __pycache__ of a variant whose digest matches")
def _():
    folder = WORK / "pyc" / "variant"
    _digest_variant(folder, {"__init__.py": b"VALUE = 1\n"})
    evil = WORK / "pyc" / "evil.py"
    evil.write_text("VALUE = 666\n")
    import importlib.util

    py_compile.compile(
        str(evil),
        cfile=importlib.util.cache_from_source(str(folder / "__init__.py")),
        invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
    )
    out = py(VERIFY, str(folder), e=env()).stdout.strip()
    return ("VULN", "Success") if out == "Success" else ("OK", out)


@attack("4", "two links to '.' in a variant")
def _():
    folder = WORK / "loop" / "variant"
    _digest_variant(folder, {"__init__.py": b"VALUE = 1\n"})
    os.symlink(".", folder / "a")
    os.symlink(".", folder / "b")
    started = time.monotonic()
    out = py(VERIFY, str(folder), e=env(), timeout=30).stdout.strip()
    return "OK", f"{out} in {time.monotonic() - started:.1f} s"


# -- 5. locks and redirects ------------------------------------------------------------------------


@attack("5", "a reference-format lock of a repo whose kernel-status.toml redirects")
def _():
    marker = WORK / "redirect-ran"
    redirect = 'kind = "redirect"\ndestination = "lab-org/new"\nrevision = "v1"\n'
    root = hub_dir(
        "redirect-hub",
        {"lab-org/old": {"kernel-status.toml": redirect}, "lab-org/new": kernel_files(marker, 2)},
        ["lab-org"],
    )
    commit = GitRepoWriter(root / "lab-org/old").head("v1")
    lock = WORK / "redirect.lock"
    dep = {"dependency": {"repo-id": "lab-org/old", "version": 1}, "lock": {"commit": commit}}
    lock.write_text(json.dumps([dep]))
    code = (
        "import sys, kernels, kernels.errors\n"
        "try:\n    print(kernels.get_locked_kernel('lab-org/old', lockfile=sys.argv[1]).VALUE)\n"
        "except kernels.errors.KernelsError as exc:\n    print(type(exc).__name__)\n"
    )
    with MirrorServer(root) as server:
        out = py(code, str(lock), e=fresh("redirect", HF_ENDPOINT=server.url))
    if marker.exists():
        return "VULN", "the destination branch's code ran"
    return ("OK" if out.stdout.strip() == "LockfileError" else "BUG"), out.stdout.strip()


# -- 6. bad input ----------------------------------------------------------------------------------


def _hostile_pull(files: dict[str, bytes], extra: dict[str, bytes] | None = None):
    e = fresh(f"pull-{len(ROWS)}", KERNELS_TRUSTED_PUBLISHERS="evil")
    with HostileHub() as hub:
        repo = KernelRepo("evil/relu", files)
        repo.install(hub)
        for path, data in (extra or {}).items():
            hub.route(
                rf"/kernels/evil/relu/resolve/[^/]+/{path}",
                lambda _s, _m, data=data: Reply(200, {"X-Repo-Commit": repo.commit}, data),
            )
        e["HF_ENDPOINT"] = hub.url
        return cli("pull", "evil/relu@main", e=e), e


@attack("6", "a kernel-status.toml of 2,000 nested arrays (4 KB)")
def _():
    status = b"kind = " + b"[" * 2000 + b"]" * 2000 + b"\n"
    base = {
        "build/torch-universal/metadata.json": metadata("relu").encode(),
        "build/torch-universal/__init__.py": b"VALUE = 1\n",
    }
    out, _e = _hostile_pull({**base, "kernel-status.toml": status}, {"kernel-status.toml": status})
    if "RecursionError" in out.stderr or "looks like a bug" in out.stderr:
        return "BUG", out.stderr.strip().splitlines()[0]
    return ("OK" if out.returncode == 1 else "BUG"), out.stderr.strip().splitlines()[0][:100]


@attack("6", "a FIFO named metadata.json, and a file name with a newline, in mirror build's SRC")
def _():
    results = []
    for kind in ("fifo", "newline"):
        src = WORK / f"src-{kind}"
        variant = src / "evil" / "relu" / "build" / "torch-universal"
        variant.mkdir(parents=True)
        (variant / "__init__.py").write_text("VALUE = 1\n")
        if kind == "fifo":
            os.mkfifo(variant / "metadata.json")
        else:
            (variant / "metadata.json").write_text(json.dumps({"version": 1}))
            (variant / "a\nb.py").write_text("X = 1\n")
        out = cli("mirror", "build", str(src), str(WORK / f"dest-{kind}"), e=env(), timeout=60)
        results.append(out.returncode == 1 and "looks like a bug" not in out.stderr)
    return ("OK" if all(results) else "BUG"), "both refused with one error line"


@attack("6", "a server-chosen file name with ESC / CR / RLO, printed by pull and verify")
def _():
    files = {
        "build/torch-universal/metadata.json": metadata("relu").encode(),
        "build/torch-universal/__init__.py": b"VALUE = 1\n",
        f"build/torch-universal/{EVIL}": b"x = 1\n",
    }
    # other bytes than listed for the evil name: pull's error names it
    out, e = _hostile_pull(files, {"build/torch-universal/%1B.*": b"changed\n"})
    seen = out.stdout + out.stderr
    ver = cli("verify", e=e)
    seen += ver.stdout + ver.stderr
    raw = [c for c in RAW if c in seen]
    return ("VULN", f"raw {raw!r} reached the terminal") if raw else ("OK", "escaped")


# -- 7. serve --------------------------------------------------------------------------------------


@attack("7", "1,100 half-sent connections against `kernels serve` with 1,024 open files")
def _():
    root = WORK / "flood"
    GitRepoWriter(root / "evil" / "relu").commit({"README.md": "relu\n"})
    serve = (
        "import resource, sys; from kernels.serve import main; "
        "resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)); sys.exit(main(sys.argv[1:]))"
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1300:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1300, hard), hard))
    server = subprocess.Popen(
        [sys.executable, "-c", serve, str(root), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    socks = []
    try:
        url = server.stdout.readline().strip().rsplit(" ", 1)[-1]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        for _ in range(1100):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"GET /api/kernels/evil/relu/refs HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        time.sleep(0.5)
        started = time.monotonic()
        from huggingface_hub import HfApi

        HfApi(endpoint=url).list_repo_refs("evil/relu", repo_type="kernel")
        took = time.monotonic() - started
    finally:
        for s in socks:
            s.close()
        server.terminate()
        server.wait(timeout=20)
    return ("OK" if took < 5 else "BUG"), f"an honest client answered in {took:.2f} s"


@attack("7", "a forged Host header and the LFS redirect's Location")
def _():
    root = WORK / "lfs"
    writer = GitRepoWriter(root / "evil" / "relu")
    writer.commit({"w.bin": writer.lfs(b"weights" * 100)})
    with MirrorServer(root) as server:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
        conn.request("HEAD", "/evil/relu/resolve/main/w.bin", headers={"Host": "attacker.example"})
        location = conn.getresponse().getheader("Location") or ""
    if "attacker" in location:
        return "VULN", location
    return "OK", location[:40]


# -- the reference CLI and messages ----------------------------------------------------------------


@attack("ref", "`kernels download DIR` and `kernels verify-signature REPO N --filter-unsigned`")
def _():
    marker = WORK / "ref-ran"
    root = hub_dir("ref-hub", {"lab-org/act": kernel_files(marker)}, ["lab-org"])
    project = WORK / "ref-project"
    project.mkdir()
    (project / "pyproject.toml").write_text('[tool.kernels.dependencies]\n"lab-org/act" = 1\n')
    with MirrorServer(root) as server:
        e = fresh("ref", HF_ENDPOINT=server.url)
        codes = [
            cli("lock", str(project), e=e).returncode,
            cli("download", str(project), e=e).returncode,
            cli("download", str(project), "--all-variants", e=e).returncode,
            cli("verify-signature", "lab-org/act", "1", e=e).returncode,
            cli("verify-signature", "lab-org/act", "1", "--filter-unsigned", e=e).returncode,
        ]
    ok = codes == [0, 0, 0, 1, 0] and not marker.exists()
    return ("OK" if ok else "BUG"), f"exit codes {codes} (want [0, 0, 0, 1, 0])"


@attack("ref", "the reference's words: untrusted, offline miss, use_kernelized_func")
def _():
    marker = WORK / "msg-ran"
    root = hub_dir("msg-hub", {"other-org/act": kernel_files(marker)}, [])
    code = (
        "import kernels, kernels.errors\n"
        "try:\n    kernels.get_kernel('other-org/act', version=1)\n"
        "except kernels.errors.KernelsError as exc:\n    print(exc)\n"
    )
    with MirrorServer(root) as server:
        untrusted = py(code, e=fresh("msg", HF_ENDPOINT=server.url)).stdout
    offline = py(code, e=fresh("msg2", HF_HUB_OFFLINE="1")).stdout
    func = py(
        "import torch\nfrom kernels import use_kernelized_func\n"
        "def f(x):\n    return x\n"
        "try:\n    use_kernelized_func(f)(type('C', (torch.nn.Module,), {}))\n"
        "except Exception as exc:\n    print(exc)\n",
        e=env(),
    ).stdout
    found = [
        "is not from a trusted publisher" in untrusted,
        "Cannot find a local snapshot" in offline,
        "is not decorated with @use_kernel_forward_from_hub" in func,
    ]
    return ("OK" if all(found) else "BUG"), f"{found}"


def main() -> int:
    bad = [r for r in ROWS if r[2] != "OK"]
    print(f"\n{len(ROWS)} attacks: {len(ROWS) - len(bad)} OK, {len(bad)} not OK")
    shutil.rmtree(WORK, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
