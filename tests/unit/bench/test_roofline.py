"""``kvasir bench --roofline``: bandwidth and product throughput at a model's shapes."""

from __future__ import annotations

from kvasir.bench.roofline import model_products, print_roofline, roofline_report
from kvasir.model.source import resolve_source


def test_products_follow_the_model_config():
    source = resolve_source("smollm2-135m")  # 576 hidden, 9 heads of 64, 3 KV heads, 1536, 49152
    shapes = {p.name: (p.inputs, p.outputs) for p in model_products(source)}
    assert shapes == {
        "qkv": (576, 960),
        "o": (576, 576),
        "gate_up": (576, 3072),
        "down": (1536, 576),
        "lm_head": (576, 49152),
    }


def test_report_measures_every_product_at_every_row_count_per_thread_count(tiny_models):
    source = resolve_source(str(tiny_models["llama"]))
    report = roofline_report(source, threads=(1, 2), floats=1 << 16, rows=(2, 8), budget=0.001)
    assert set(report["threads"]) == {"1", "2"}
    for entry in report["threads"].values():
        assert entry["copy_gb_s"] > 0 and entry["triad_gb_s"] > 0
        cells = {(p["product"], p["rows"]) for p in entry["products"]}
        assert cells == {(name, rows) for name in ("qkv", "o", "gate_up", "down", "lm_head") for rows in (2, 8)}
        best = max(max(p["gflop_s"], p["packed_gflop_s"] or 0) for p in entry["products"])
        assert entry["peak_gflop_s"] == best > 0
        assert entry["ridge_flop_per_byte"] == entry["peak_gflop_s"] / entry["copy_gb_s"]
    lines: list[str] = []
    print_roofline(report, lines.append)
    assert any(line.strip().startswith("lm_head   64x320") for line in lines)
    assert sum("thread(s): copy" in line for line in lines) == 2


def test_stage_rates_count_the_slices_products_per_busy_second(tiny_models):
    from kvasir.bench.roofline import stage_rates

    source = resolve_source("smollm2-135m")
    layer = 576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576  # one layer's weights, fused as run
    stage = {"layers": [17, 30], "busy": 0.5, "window_s": 10.0, "batches_per_s": 4.0}
    stage |= {"tokens_per_batch": 40.0, "rows_per_batch": 14.0}
    held = 4 * (13 * layer + 576 * 49152)  # float32, as the stage holds them
    tail = stage_rates(source, stage, is_tail=True, weight_bytes=held)
    # 40 batches in 5 busy seconds: 1,600 tokens through 13 layers, 560 rows through the LM head
    flops = 2 * layer * 13 * 1600 + 2 * 576 * 49152 * 560
    assert abs(tail["gflop_s"] - flops / 5 / 1e9) < 1e-6
    assert abs(tail["weight_gb_s"] - held * 40 / 5 / 1e9) < 1e-6
    inner = stage_rates(source, stage, is_tail=False, weight_bytes=4 * 13 * layer)
    assert inner["gflop_s"] < tail["gflop_s"] and inner["weight_gb_s"] < tail["weight_gb_s"]
    assert stage_rates(resolve_source(str(tiny_models["mixtral"])), stage, is_tail=True, weight_bytes=held) == {}
