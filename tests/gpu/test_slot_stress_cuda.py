"""The GPU edges' slot rings under stress, and the negative control that shows the stress
can catch a race (tests/gpu/slot_stress.py; skipped where CUDA is absent)."""

from __future__ import annotations

import pytest
import torch
from slot_stress import run_stress

from tests.support.gpu import gpu_under_test

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible"),
]

GPU = gpu_under_test()
HAND_OFFS = 3000


@pytest.mark.parametrize("kind", ["cuda-ipc", "pinned"])
def test_every_boundary_arrives_whole_under_random_stream_delays(kind, record_property):
    outcome = run_stress(kind, GPU, HAND_OFFS)
    record_property("summary", outcome.line())
    assert outcome.wrong == 0, outcome.line()


@pytest.mark.parametrize("kind", ["cuda-ipc", "pinned"])
def test_the_same_stress_with_one_wait_left_out_gets_wrong_sums(kind, record_property):
    outcome = run_stress(kind, GPU, HAND_OFFS, broken=True)
    record_property("summary", outcome.line())
    assert outcome.wrong > 0, outcome.line()
