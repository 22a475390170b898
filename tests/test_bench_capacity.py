"""The size search of scripts/bench_capacity.py: doubling, then halving the gap, on a fake GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from bench_capacity import _search  # noqa: E402


@pytest.mark.parametrize("limit", [1, 5, 8, 9, 150, 4095])
def test_brackets_the_largest_size_that_fits(limit):
    probes = []

    def fits(n):
        probes.append(n)
        return n <= limit

    result = _search(fits, start=8, step=1, bisect=20, limit=4096)
    assert result["fits"] == limit and result["oom"] == limit + 1
    assert [p for p, _ in result["probes"]] == probes  # every probe is recorded, in order


def test_stops_after_the_requested_halvings_on_the_step_grid():
    result = _search(lambda n: n <= 140_000, start=16384, step=1024, bisect=3, limit=1 << 21)
    assert (result["fits"], result["oom"]) == (131072, 147456)
    assert all(size % 1024 == 0 for size, _ in result["probes"])
    assert len(result["probes"]) == 5 + 3  # 16k..256k doubling, then three halvings


def test_nothing_fits_and_search_limit():
    assert _search(lambda n: False, 8, 1, 3, 4096)["fits"] is None
    everything = _search(lambda n: True, 8, 1, 3, 64)
    assert everything["fits"] == 64 and everything["oom"] is None
