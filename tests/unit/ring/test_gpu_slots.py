"""What the GPU slot rings decide without a GPU: whether the CUDA allocator settings turn
on expandable segments, whose memory the slots must not come from."""

from __future__ import annotations

from kvasir.ring.gpu_slots import expandable_segments


def test_expandable_segments_are_read_from_either_allocator_setting():
    assert not expandable_segments({})
    assert not expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})
    assert not expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64, expandable_segments : true"})
    assert expandable_segments({"PYTORCH_ALLOC_CONF": "expandable_segments:True"})  # the newer name
    assert not expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"})
