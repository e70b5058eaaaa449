"""model.dtype = "auto": the checkpoint's dtype where every CPU worker has it natively."""

from __future__ import annotations

import pytest

from kvasir.daemon.dtype import auto_dtype, checkpoint_dtype, cpu_flags

BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
PLAIN = frozenset({"avx2", "avx512f"})


@pytest.mark.parametrize(
    ("config", "gguf", "wanted"),
    [
        ("bfloat16", False, "bfloat16"),
        ("torch.float16", False, "float16"),
        (None, False, "float32"),
        ("float64", False, "float32"),  # not a dtype Kvasir serves
        ("float32", True, "bfloat16"),  # a GGUF's matrices as stored want bfloat16
    ],
)
def test_what_the_checkpoint_wants(config, gguf, wanted):
    assert checkpoint_dtype(config, gguf)[0] == wanted


def test_half_precision_only_where_every_cpu_worker_has_it_natively():
    assert auto_dtype("bfloat16", "the checkpoint's dtype", ["cpu"], BF16).dtype == "bfloat16"
    slow = auto_dtype("bfloat16", "the checkpoint's dtype", ["cpu", "cpu"], PLAIN)
    assert slow.dtype == "float32" and "not native on this CPU (no avx512_bf16 or amx_bf16)" in slow.why
    assert auto_dtype("float16", "x", ["cpu"], BF16).dtype == "float32"
    assert auto_dtype("float16", "x", ["cpu"], frozenset({"amx_fp16"})).dtype == "float16"
    assert auto_dtype("bfloat16", "x", ["cuda:0"], PLAIN).dtype == "bfloat16"  # a GPU computes it natively
    assert auto_dtype("float32", "the checkpoint's dtype", ["cpu"], BF16).why == "the checkpoint's dtype"


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu avx2 avx512_bf16\n"
    )
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()
