"""A stage's torch threads follow the head's mark on each batch."""

from __future__ import annotations

import pytest
import torch

from kvasir.model.pinning import Threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_solo_batch_runs_on_the_solo_threads_and_the_next_on_the_usual(restore_threads):
    torch.set_num_threads(1)  # what pin_process set
    threads = Threads(1, 2)
    threads.follow(solo=True)
    assert torch.get_num_threads() == 2
    threads.follow(solo=False)
    assert torch.get_num_threads() == 1


def test_without_solo_threads_the_count_never_changes(restore_threads):
    torch.set_num_threads(1)
    threads = Threads(1, None)
    threads.follow(solo=True)
    assert torch.get_num_threads() == 1
