"""``kvasir bench roofline``: the most this machine can do, to set every speed figure against.

Memory bandwidth as STREAM measures it (copy: b = a; triad: a = b + s * c; bytes read
plus written, over arrays far larger than the caches) and float32 matrix-product
throughput with torch at the model's own shapes (each layer's projections and the LM
head, at a decode batch's row count and at prefill ones), plain ``F.linear`` and with
the weight packed once as the stages run it (kvasir/model/packed.py); each with 1 and
2 threads (or the given counts). The compute ceiling is the best product throughput;
a batch whose products read more bytes per flop than ceiling / bandwidth is bound by
memory.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from kvasir.model.packed import PackedLinear, packing_available
from kvasir.model.source import ModelSource

STREAM_FLOATS = 64 * 1024 * 1024  # 256 MiB per array
ROWS = (16, 128, 512)  # a decode batch's rows, a prefill chunk's, a long prompt's


@dataclass(frozen=True)
class Product:
    name: str
    inputs: int
    outputs: int


def model_products(source: ModelSource) -> list[Product]:
    """The matrix products of one decoder layer (projections fused as the stages run them)
    and the LM head."""
    config = source.config
    hidden, heads = config.hidden_size, config.num_attention_heads
    return [
        Product("qkv", hidden, (heads + 2 * source.kv_heads) * source.head_dim),
        Product("o", heads * source.head_dim, hidden),
        Product("gate_up", hidden, 2 * config.intermediate_size),
        Product("down", config.intermediate_size, hidden),
        Product("lm_head", hidden, source.vocab_size),
    ]


def stage_rates(source: ModelSource, stage: dict, is_tail: bool, weight_bytes: int) -> dict:
    """What a stage achieved over a measured window (a ``stage_fractions`` entry): GFLOP/s
    of its matrix products and GB/s of weights read (each batch reads ``weight_bytes``,
    every weight of the slice as held, once), per busy second. Attention's own products
    are left out (a few percent at these lengths); a mixture-of-experts model gets
    nothing (its products depend on routing)."""
    if source.moe is not None:
        return {}
    shapes = model_products(source)
    layer = sum(p.inputs * p.outputs for p in shapes if p.name != "lm_head")
    head = next(p.inputs * p.outputs for p in shapes if p.name == "lm_head") if is_tail else 0
    first, last = stage["layers"]
    busy_s = max(stage["busy"] * stage["window_s"], 1e-9)
    batches = stage["batches_per_s"] * stage["window_s"]
    tokens, rows = stage["tokens_per_batch"] * batches, stage["rows_per_batch"] * batches
    flops = 2 * layer * (last - first) * tokens + 2 * head * rows  # the LM head runs on emitting rows (<= rows)
    weights = weight_bytes * batches
    return {"gflop_s": flops / busy_s / 1e9, "weight_gb_s": weights / busy_s / 1e9}


def _seconds(run: Callable[[], object], budget: float, least: int = 3) -> float:
    """Median seconds of ``run`` over at least ``least`` calls and about ``budget`` seconds."""
    run()
    times: list[float] = []
    spent = 0.0
    while len(times) < least or spent < budget:
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
        spent += times[-1]
    return statistics.median(times)


def stream(floats: int, budget: float) -> dict[str, float]:
    """Copy and triad bandwidth, GB/s (10^9 bytes), read and written bytes counted."""
    a, b, c = (torch.rand(floats) for _ in range(3))
    size = a.nbytes
    copy = _seconds(lambda: b.copy_(a), budget)
    triad = _seconds(lambda: torch.add(b, c, alpha=3.0, out=a), budget)
    return {"copy_gb_s": 2 * size / copy / 1e9, "triad_gb_s": 3 * size / triad / 1e9}


def products(shapes: list[Product], rows: tuple[int, ...], budget: float) -> list[dict]:
    """GFLOP/s of each product at each row count, plain and packed (weights stay cached)."""
    figures = []
    for product in shapes:
        linear = torch.nn.Linear(product.inputs, product.outputs, bias=False)
        packed = PackedLinear(linear) if packing_available() else None
        for count in rows:
            x = torch.randn(count, product.inputs)
            flops = 2 * count * product.inputs * product.outputs
            with torch.inference_mode():
                plain = flops / _seconds(partial(F.linear, x, linear.weight), budget) / 1e9
                fast = flops / _seconds(partial(packed, x), budget) / 1e9 if packed is not None else None
            figures.append(
                {
                    "product": product.name,
                    "shape": [product.inputs, product.outputs],
                    "rows": count,
                    "gflop_s": plain,
                    "packed_gflop_s": fast,
                }
            )
    return figures


def roofline_report(
    source: ModelSource,
    threads: tuple[int, ...] = (1, 2),
    floats: int = STREAM_FLOATS,
    rows: tuple[int, ...] = ROWS,
    budget: float = 0.4,
) -> dict:
    """Bandwidth and product throughput per thread count, with each count's ceilings
    (``budget``: about how many seconds each figure is measured for)."""
    before = torch.get_num_threads()
    report: dict = {"model": source.name, "packing": packing_available(), "threads": {}}
    try:
        for count in threads:
            torch.set_num_threads(count)
            bandwidth = stream(floats, budget)
            figures = products(model_products(source), rows, budget)
            peak = max(max(p["gflop_s"], p["packed_gflop_s"] or 0.0) for p in figures)
            report["threads"][str(count)] = {
                **bandwidth,
                "products": figures,
                "peak_gflop_s": peak,
                "ridge_flop_per_byte": peak / bandwidth["copy_gb_s"],
            }
    finally:
        torch.set_num_threads(before)
    return report


def print_roofline(report: dict, say: Callable[[str], None]) -> None:
    say(f"model {report['model']}: float32 products at its shapes (GFLOP/s, plain / packed)")
    for count, entry in report["threads"].items():
        say(
            f"{count} thread(s): copy {entry['copy_gb_s']:.1f} GB/s, triad {entry['triad_gb_s']:.1f} GB/s; "
            f"peak {entry['peak_gflop_s']:.0f} GFLOP/s; ridge {entry['ridge_flop_per_byte']:.1f} flop/byte"
        )
        rows = sorted({p["rows"] for p in entry["products"]})
        say("    product   shape          " + "".join(f"{r:>6} rows      " for r in rows))
        for name in dict.fromkeys(p["product"] for p in entry["products"]):
            cells = [p for p in entry["products"] if p["product"] == name]
            shape = "x".join(str(n) for n in cells[0]["shape"])
            figures = "".join(f"{_cell(p):>17}" for p in cells)
            say(f"    {name:<9} {shape:<14}{figures}")


def _cell(product: dict) -> str:
    packed = product["packed_gflop_s"]
    return f"{product['gflop_s']:.0f} / {packed:.0f}" if packed is not None else f"{product['gflop_s']:.0f} / -"
