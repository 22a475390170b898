"""Helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import contextlib


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", help="select variants for this backend (cpu or the detected one)"
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="trust this kernel's publisher for this command (it runs the kernel's code on load)",
    )


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


@contextlib.contextmanager
def progress_bar(enabled: bool):
    """A byte counter for downloads (huggingface_hub's tqdm), or None when disabled."""
    if not enabled:
        yield None
        return
    from huggingface_hub.utils import tqdm

    bar = tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="downloading", leave=False)
    try:
        yield bar.update
    finally:
        bar.close()


def spec_with_default_ref(text: str):
    """Parse 'org/repo[@ref]'; without a ref use the newest v<N> branch (one request), else main."""
    from ..errors import InvalidSpec
    from ..spec import make_spec, parse_spec
    from .hints import SPEC_HINT_NO_LAYER

    try:
        spec = parse_spec(text, require_ref=False)
    except InvalidSpec as exc:
        if exc.hint != InvalidSpec.hint:  # a specific hint (e.g. the spec for a pasted URL)
            raise
        raise InvalidSpec(exc.message, hint=SPEC_HINT_NO_LAYER) from None
    if spec.path is not None or spec.layer is not None:
        raise InvalidSpec(f"{text!r}: expected org/repo[@revision]", hint=SPEC_HINT_NO_LAYER)
    if spec.ref is not None:
        return spec
    from .. import settings

    if settings.offline():
        from ..errors import OfflineCacheMiss

        raise OfflineCacheMiss(f"{text}: offline; give a version or revision (e.g. {text}@v1)")
    from ..resolve import available_versions

    versions = available_versions(spec.repo_id)
    if versions:
        return make_spec(spec.repo_id, version=max(versions))
    return make_spec(spec.repo_id, revision="main")


def plural(count: int, noun: str) -> str:
    """'1 file', '3 files'."""
    return f"{count} {noun}{'' if count == 1 else 's'}"
