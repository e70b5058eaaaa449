"""``model.dtype = "auto"``: the dtype a model is served in, chosen once per plan.

The checkpoint's own dtype (a model folder's ``config.json``; a GGUF file's quantised
matrices are served as stored in bfloat16, kvasir/model/quant/), kept where every CPU
worker computes in it natively — bfloat16 with AVX512-BF16 or AMX, float16 with
AVX512-FP16 or AMX-FP16, read from /proc/cpuinfo — and float32 otherwise: emulated half
precision on a CPU is slower than float32. CUDA devices compute both natively.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvasir.config.devices import DTYPES

NATIVE_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str
    why: str


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This machine's CPU feature flags (empty where /proc/cpuinfo has none)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def checkpoint_dtype(config_dtype: object, gguf: bool, quantized: bool = False) -> tuple[str, str]:
    """The dtype a model's weights want and where that comes from: packed matrices (a
    GGUF file's, a quantized checkpoint's) are served as stored in bfloat16; a folder's
    config names its own (float32 where it names none Kvasir serves)."""
    if gguf:
        return "bfloat16", "a GGUF file's matrices are served as stored in bfloat16"
    if quantized:
        return "bfloat16", "a quantized checkpoint's matrices are served as stored in bfloat16"
    name = str(config_dtype).removeprefix("torch.") if config_dtype is not None else "float32"
    return (name, "the checkpoint's dtype") if name in DTYPES else ("float32", f"the checkpoint's {name} is not served")


def auto_dtype(wanted: str, origin: str, devices: list[str], flags: frozenset[str]) -> DtypeChoice:
    """``wanted`` (for the reason ``origin``) where every CPU worker computes in it
    natively, else float32."""
    if wanted == "float32":
        return DtypeChoice("float32", origin)
    native = sorted(set(NATIVE_FLAGS[wanted]) & flags)
    if "cpu" in devices and not native:
        return DtypeChoice("float32", f"{origin}, not native on this CPU (no {' or '.join(NATIVE_FLAGS[wanted])})")
    where = f"native on this CPU: {', '.join(native)}" if "cpu" in devices else "on CUDA devices"
    return DtypeChoice(wanted, f"{origin}, {where}")
