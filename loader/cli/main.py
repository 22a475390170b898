"""`kernels` command line: argument parsing and dispatch.

Each subcommand lives in its own module and is imported only when it runs, so `kernels --help`
imports neither torch nor huggingface_hub. Exit codes: 0 ok, 1 failure, 2 usage error. A user
error prints one line and a hint, never a traceback (set KERNELS_DEBUG=1 to see one).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .._version import __version__

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2

# name -> (module under kernels.cli, one-line help)
COMMANDS = {
    "pull": ("pull", "download and verify a kernel into the cache"),
    "lock": ("lock", "write kernels.lock from pyproject.toml [tool.kernels.dependencies]"),
    "sync": ("lock", "install exactly what kernels.lock says and verify it"),
    "ls": ("cache_cmds", "list cached kernels"),
    "du": ("cache_cmds", "show the cache's disk usage"),
    "verify": ("cache_cmds", "check cached files against their digests"),
    "prune": ("cache_cmds", "remove cached files nothing references"),
    "info": ("info", "describe a kernel (Hub repo or local path)"),
    "versions": ("info", "list a kernel's versions and which variant fits here"),
    "env": ("info", "show this machine as the loader sees it"),
    "serve": ("serve", "serve a folder of kernel repos over the Hub's HTTP protocol"),
    "export": ("export", "write cached kernels as a folder `kernels serve` can serve"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kernels",
        description="Load, cache, lock and serve compute kernels from the Hugging Face Hub.",
        epilog="Exit codes: 0 ok, 1 failure, 2 usage error. Docs: docs/cli.md.",
    )
    parser.add_argument("--version", action="version", version=f"kernels {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _subparser(name: str) -> argparse.ArgumentParser:
    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(f".{module_name}", __package__)
    parser = argparse.ArgumentParser(prog=f"kernels {name}", description=help_text)
    getattr(module, f"add_{name}_arguments")(parser)
    parser.set_defaults(_run=getattr(module, f"run_{name}"))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        build_parser().print_help()
        return EXIT_OK if argv else EXIT_USAGE
    if argv[0] == "--version":
        print(f"kernels {__version__}")
        return EXIT_OK
    name = argv[0]
    if name not in COMMANDS:
        build_parser().parse_args(argv)  # prints usage and exits 2
        return EXIT_USAGE
    if name == "serve":  # the server owns its own argument parsing
        from kernels.serve import main as serve_main

        return serve_main(argv[1:])
    args = _subparser(name).parse_args(argv[1:])
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        return report_error(exc)


def report_error(exc: BaseException) -> int:
    from ..errors import KernelsError

    if os.environ.get("KERNELS_DEBUG"):
        raise exc
    if isinstance(exc, KernelsError):
        lines = exc.message.splitlines()
        print(f"error: {lines[0]}", file=sys.stderr)
        for line in lines[1:]:
            print(f"  {line}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return EXIT_FAIL
    print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
    print(
        "hint: this looks like a bug in kernels; rerun with KERNELS_DEBUG=1 and report it",
        file=sys.stderr,
    )
    return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
