"""The GPU the GPU tests use: $KVASIR_GPU, default cuda:0 (scripts/gpu-check sets it)."""

from __future__ import annotations

import os


def gpu_under_test() -> str:
    return os.environ.get("KVASIR_GPU", "cuda:0")
