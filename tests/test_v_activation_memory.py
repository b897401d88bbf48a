"""``--log-activation-memory`` on the V schedules: the runtime's peak per device against the
timing simulator's prediction, N = 4 (issue 31), and the paper's table in the runtime's units.

The runtime's meter counts the bytes autograd saved per (micro-batch, chunk); the simulator
counts chunk activations (F +1, B ``m_w - 1``, W ``-m_w``). The unit is measured per device from
the same run: ``M_B`` = the mean bytes a chunk's micro-batch held before its B, ``m_w`` = the
share its B kept for W (the profiler's counters, as tests/test_zero_bubble_memory.py does).

Devices 1..N-1 hold two identical one-layer chunks: every chunk's micro-batch saves the same
storages, so the runtime's peak is ``a M_B + b M_W`` for whole ``a, b`` and the simulator's
``a + b m_w``; they agree to rounding (1e-6 relative, as on a chain). Device 0 holds the
embedding (chunk 0) and the final norm, head and loss (chunk 1): one chunk activation is not
one mean unit, and the mix held at peak is priced within the two chunks' spread around their
mean. There the issue's 10 % applies; measured 5.5 % (v-min) to 8.3 % (zb-v) *below* the
prediction at N = 4, m = 8 (the device-0 peak holds more of the smaller chunk).
"""
from __future__ import annotations

import pytest

from megatron.pipeline.ir import OpKind
from megatron.pipeline.costs.op_costs import OpCosts
from megatron.pipeline.simulator import simulate_schedule
from tests.test_zero_bubble_memory import N, _build, _run

pytestmark = pytest.mark.usefixtures("megatron_world1")

V_SCHEDULES = ("zb-v", "v-half", "v-min", "dualpipev")
M = 2 * N  # m = 2N, the smallest DualPipeV takes
#: whole-stage activations (chunk units / 2) the paper gives; DualPipeV: its README's 2N + 1 chunks
PAPER_PEAK = {"zb-v": N, "v-half": (N + 2) // 2, "v-min": (N + 4) // 3, "dualpipev": (2 * N + 1) / 2}


@pytest.fixture(scope="module")
def measured(megatron_world1) -> dict[str, tuple[list[float], list[float]]]:
    """name -> (runtime peak per device in mean chunk units, simulated peak in chunk units)."""
    out = {}
    for name in V_SCHEDULES:
        # zb-v plans with the trainer's costs without profiling: M_W / M_B = 1, the most W can
        # keep (tests/test_zero_bubble_memory.py: planned with 1/2, a ZB order overshoots)
        schedule = _build(name, m=M, iterations=1, **({"costs": OpCosts(m_w=1.0)} if name == "zb-v" else {}))
        workers = _run(schedule, profilers=True)
        units, ratios = [], []
        for w in workers:
            n_b = len(w.profiler.times[OpKind.B])  # every device splits some Bs (DualPipeV too)
            units.append(w.profiler.bytes_forward / n_b)
            ratios.append(w.profiler.bytes_kept / w.profiler.bytes_forward)
        runtime = [w.meter.run_peak_bytes / u for w, u in zip(workers, units)]
        simulated = simulate_schedule(schedule, [OpCosts(m_w=r) for r in ratios]).peak_memory
        out[name] = runtime, simulated
    return out


@pytest.mark.parametrize("name", V_SCHEDULES)
def test_runtime_peak_per_device_within_10_percent_of_the_simulator(name: str, measured) -> None:
    runtime, simulated = measured[name]
    assert abs(runtime[0] - simulated[0]) <= 0.10 * simulated[0], (runtime, simulated)
    assert runtime[1:] == pytest.approx(simulated[1:], rel=1e-6), (runtime, simulated)


@pytest.mark.parametrize("name", V_SCHEDULES)
def test_runtime_peak_follows_the_papers_table(name: str, measured) -> None:
    """The runtime's highest device (a middle one, exact above) at the paper's whole-stage peak."""
    runtime, _ = measured[name]
    assert max(runtime) / 2 == pytest.approx(PAPER_PEAK[name], rel=1e-6), runtime
