"""`kernels` command line: argument parsing and dispatch.

Each subcommand lives in its own module and is imported only when it runs, so `kernels --help`
imports neither torch nor huggingface_hub. Exit codes: 0 ok, 1 failure, 2 usage error (a
malformed argument, spec or flag). A user error prints one `error:` line and one `hint:` line in
the command line's own terms, never a traceback (set KERNELS_DEBUG=1 to see one).

Every command that prints data takes `--json` (docs/cli.md lists the schemas); every command
takes `-q` (print nothing but errors and warnings) and `-v` (also say how things were decided).
"""

from __future__ import annotations

import argparse
import contextlib
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
    "download": ("download", "install what PROJECT_DIR/kernels.lock pins (the reference's name)"),
    "ls": ("cache_cmds", "list cached kernels"),
    "du": ("cache_cmds", "show the cache's disk usage"),
    "verify": ("cache_cmds", "check cached files against their digests (--repair re-fetches)"),
    "verify-signature": (
        "verify_signature",
        "check a kernel version's Sigstore signature and its files against the signed digest",
    ),
    "prune": ("cache_cmds", "remove cached files nothing references"),
    "info": ("info", "describe a kernel (Hub repo or local path)"),
    "versions": ("info", "list a kernel's versions and which variant fits here"),
    "env": ("info", "show this machine as the loader sees it"),
    "mirror": ("mirror", "build a servable mirror from kernel folders in Hub layout"),
    "serve": ("serve", "serve a folder of kernel repos over the Hub's HTTP protocol"),
    "export": ("export", "write cached kernels as a folder `kernels serve` can serve"),
}
# Commands that never touch the cache, or (env) report a bad one: a bad KERNELS_CACHE must not
# stop them.
_NO_CACHE = {"serve", "mirror", "env"}


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error printed the command line's way: one `error:` line and one
    `hint:` line (a mistyped flag gets the closest real one: hints.unknown_flag_hint)."""

    def error(self, message: str):  # type: ignore[override]
        from .hints import usage_hint

        print(f"error: {self.prog}: {message}", file=sys.stderr)
        print(f"hint: {usage_hint(self, message)}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kernels",
        description="Load, cache, lock and serve compute kernels from the Hugging Face Hub.",
        epilog="Exit codes: 0 ok, 1 failure, 2 usage error. "
        "Run `kernels COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"kernels {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _subparser(name: str) -> argparse.ArgumentParser:
    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(f".{module_name}", __package__)
    parser = _Parser(prog=f"kernels {name}", description=help_text)
    function = name.replace("-", "_")
    getattr(module, f"add_{function}_arguments")(parser)
    noise = parser.add_mutually_exclusive_group()
    noise.add_argument(
        "-q", "--quiet", action="store_true", help="print nothing but errors and warnings"
    )
    noise.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also say how things were decided, to stderr (e.g. pull: every variant's verdict)",
    )
    parser.set_defaults(_run=getattr(module, f"run_{function}"))
    return parser


def unknown_command(name: str) -> int:
    """Usage error for a mistyped command, with the closest real one when there is one."""
    import difflib

    print(f"error: {name!r} is not a kernels command", file=sys.stderr)
    close = difflib.get_close_matches(name, COMMANDS, n=1, cutoff=0.6)
    if close:
        print(f"hint: did you mean `kernels {close[0]}`?", file=sys.stderr)
    else:
        print("hint: run `kernels --help` to list the commands", file=sys.stderr)
    return EXIT_USAGE


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
        if name.startswith("-"):
            build_parser().parse_args(argv)  # prints usage and exits 2
        return unknown_command(name)
    if name == "serve":  # the server owns its own argument parsing
        from kernels.serve import main as serve_main

        return serve_main(argv[1:])
    args = _subparser(name).parse_args(argv[1:])
    stdout = sys.stdout
    try:
        _configure_output(args)
        if name not in _NO_CACHE:
            _check_cache_root()
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kernels ... | head`: the reader left; nothing more to say
        # What is still buffered goes nowhere, so the interpreter's flush at exit cannot fail.
        with contextlib.suppress(OSError, ValueError, AttributeError):  # not a real file
            os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
        return EXIT_FAIL
    except Exception as exc:
        return report_error(exc)
    finally:
        if sys.stdout is not stdout:  # -q: main() may run in-process (tests), so restore
            sys.stdout.close()
            sys.stdout = stdout


def _configure_output(args: argparse.Namespace) -> None:
    """-q silences stdout (errors and warnings still go to stderr); -v lets the loader's INFO
    records through to stderr (commands add their own detail, e.g. pull's variant trace).

    Without -v logging is left alone: the loader's notices are warnings, which Python's
    last-resort handler already prints to stderr.
    """
    if args.quiet:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - closed by main()
    if args.verbose:
        import logging

        logger = logging.getLogger("kernels")
        if not logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _check_cache_root() -> None:
    """A KERNELS_CACHE that names a file (or a path under one) is an error, not an empty cache."""
    from .. import settings
    from ..guard import check_cache_root

    check_cache_root(settings.cache_root())


def report_error(exc: BaseException) -> int:
    """Print a KernelsError as `error:` + `hint:` in CLI terms; return the exit status."""
    from ..errors import InvalidSpec, KernelsError
    from ..safe_text import safe_lines, safe_text
    from .hints import cli_hint

    if os.environ.get("KERNELS_DEBUG"):
        raise exc
    # Messages carry server-chosen text (file names, error bodies): each line is escaped, and
    # only a newline starts a new one (a CR inside a name must not).
    if isinstance(exc, KernelsError):
        lines = safe_lines(exc.message)
        print(f"error: {lines[0]}", file=sys.stderr)
        for line in lines[1:]:
            print(f"  {line}", file=sys.stderr)
        hint = cli_hint(exc)
        if hint:
            print(f"hint: {safe_text(hint)}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, InvalidSpec) else EXIT_FAIL
    lines = safe_lines(f"{type(exc).__name__}: {exc}")
    print(f"error: {lines[0]}", file=sys.stderr)
    for line in lines[1:]:
        print(f"  {line}", file=sys.stderr)
    print(
        "hint: this looks like a bug in kernels; rerun with KERNELS_DEBUG=1 and report it",
        file=sys.stderr,
    )
    return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
