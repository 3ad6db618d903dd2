"""bench-serving's share of the host's CPU time stolen by its hypervisor, from two readings of the CPU times."""

from __future__ import annotations

from collections import namedtuple

import pytest

from bench.bench_serving import steal_share

pytestmark = pytest.mark.unit

Times = namedtuple("Times", "user nice system idle iowait irq softirq steal guest guest_nice")
NoSteal = namedtuple("NoSteal", "user system idle")


def test_steal_is_a_share_of_the_time_between_two_readings_guest_time_counted_once():
    before = Times(10.0, 0.0, 5.0, 100.0, 1.0, 0.0, 0.0, 2.0, 7.0, 0.0)
    # 6 s of user (3 of them a guest's, already in user's), 1 of system, 2 idle, 1 stolen: 1 / 10.
    after = Times(16.0, 0.0, 6.0, 102.0, 1.0, 0.0, 0.0, 3.0, 10.0, 0.0)
    assert steal_share(before, after) == pytest.approx(0.1)
    assert steal_share(before, before) is None  # no time between them
    assert steal_share(NoSteal(1.0, 1.0, 1.0), NoSteal(2.0, 2.0, 2.0)) is None  # a kernel that does not say
