"""Red team, issue 28 item 6 re-run: kernel-status.toml shapes the fix did not name (deep
table headers, arrays of tables, 4,000-digit integers, control characters, NUL, lone
surrogates, duplicate keys). Each is one short KernelStatusError line within the cap's parse
time; none is a crash. All fail as they should.
"""

from __future__ import annotations

import time

import pytest
from kernels.errors import KernelStatusError
from kernels.status import MAX_BYTES
from kernels.status_file import parse

N = MAX_BYTES
CASES = {
    "dotted key": "a" + ".a" * ((N - 5) // 2) + "=1",
    "table header": "[" + "a." * ((N - 3) // 2) + "a]",
    "array of tables": "[[" + "a." * ((N - 5) // 2) + "a]]",
    "many arrays of tables": "[[a]]\n" * (N // 6),
    "inline tables": "x=" + "{a=" * ((N - 3) // 3),
    "4000-digit kind": "kind=" + "9" * 4000,
    "4000-digit hex kind": "kind=0x" + "f" * 4000,
    "long float kind": "kind=" + "1" * 2000 + "." + "1" * 2000,
    "escape in revision": 'kind="redirect"\ndestination="a/b"\nrevision="\\u001b[2K"\n',
    "bidi in destination": 'kind="redirect"\ndestination="a/\\u202eb"\n',
    "NUL": 'kind="redirect"\x00',
    "lone surrogate": 'kind="\\ud800"',
    "duplicate key": 'kind="redirect"\nkind="redirect"',
    "destination table": 'kind="redirect"\n[destination]\nx=1\n',
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pathological_status_files_are_one_short_line(name):
    started = time.perf_counter()
    with pytest.raises(KernelStatusError) as err:
        parse(CASES[name])
    assert time.perf_counter() - started < 5
    message = err.value.message
    assert "\n" not in message and len(message) < 300 and message.isprintable(), message
