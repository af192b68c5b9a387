"""`phalanx plan --measure-profile FILE` (plan/calibrate.py, issue 55 item 2): two gloo ranks time a
matmul and all-reduces, and the profile they write is one `--device-profile FILE` reads back."""

from __future__ import annotations

import math

import pytest

from phalanx.plan import calibrate, device_profiles


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_this_machine_is_measured_into_a_profile_the_plan_reads(tmp_path):
    measured = calibrate.measure(seconds=1.0)
    for figure in (measured.peak_flops, measured.intra_bandwidth, measured.intra_latency, measured.memory_bandwidth):
        assert math.isfinite(figure) and figure > 0
    assert measured.intra_latency < 0.1 and measured.dtype_bytes == 4 and measured.overlap == 0.0
    assert 0 < measured.matmul_efficiency <= 1  # a transformer block's FLOP/s over the bare matmul's
    path = tmp_path / "cpu.json"
    path.write_text(measured.to_json())
    assert device_profiles.load(str(path)) == measured
