"""``--profile``'s transport measurement on a CPU host (:mod:`megatron.trainer.tasks.link_profile`):
real processes over gloo, so the checks are what the numbers must satisfy on any host, not values."""
from __future__ import annotations

import math

from megatron.trainer.tasks.link_profile import measure_link


def test_measured_link_costs_are_physical() -> None:
    """A 128 KiB message costs some CPU and at most a few ms; a collective's time per byte is
    that of a memory copy or slower (over 0.01 ns per byte, i.e. under 100 GB/s) and below a
    byte per microsecond; time-shared, a message costs some CPU too."""
    link = measure_link(128 * 1024, 4 << 20, cores=1)
    assert all(math.isfinite(v) for v in (link.p2p, link.message_cpu, link.reduce_ms_per_byte))
    assert 0.0 < link.message_cpu < 20.0 and 0.0 <= link.p2p < 20.0
    assert 1e-8 < link.reduce_ms_per_byte < 1e-3
    assert 0.0 < link.shared_message_cpu < 50.0
