"""The event clocks' results are those stored before they moved onto one engine (issue #40 item 3).

``tests/fixtures/event_clock_orders.json`` holds, for a grid of (N, m, costs), the per-stage op
orders of zb-1p, zb-2p, zb-v, v-half, v-min, dualpipev and amdp with their simulated times,
the Zero Bubble and V greedy searches' own results, more simulator paths and processor-sharing
makespans, all computed by the code before the change (``make_event_clock_fixture.py``).
Orders must match exactly and floats bitwise: JSON keeps each float's ``repr``, which
round-trips, so a float summed in another order fails here.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.event_clock_cases import compute

FIXTURE = Path(__file__).parent / "fixtures" / "event_clock_orders.json"
SECTIONS = ("costs", "schedules", "simulator", "zb_greedy", "v_greedy", "shared_cores", "orders")


@pytest.fixture(scope="module")
def results() -> tuple[dict[str, Any], dict[str, Any]]:
    """(stored, recomputed), the recomputed run through JSON like the stored one."""
    stored = json.loads(FIXTURE.read_text())
    return stored, json.loads(json.dumps(compute()))


@pytest.mark.parametrize("section", SECTIONS)
def test_results_are_the_stored_ones(results: tuple[dict[str, Any], dict[str, Any]], section: str) -> None:
    stored, now = results
    assert set(stored) == set(SECTIONS)
    if isinstance(stored[section], list):
        assert len(now[section]) == len(stored[section])
        for before, after in zip(stored[section], now[section]):
            assert after == before, before.get("case")
    else:
        changed = sorted(k for k in stored[section].keys() | now[section].keys()
                         if stored[section].get(k) != now[section].get(k))
        assert not changed, f"{section} differ at {changed[:5]}"


def test_fixture_is_small() -> None:
    assert FIXTURE.stat().st_size < 600 * 1024
