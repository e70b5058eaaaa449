"""Attention over the paged cache: in place (CPU) and gathered (accelerators) against a
plain softmax over each row's context, with scattered block tables and sliding windows."""

from __future__ import annotations

import random

import pytest
import torch

from kvasir.errors import BatchError
from kvasir.model.paged_gather import GatherPlan, attend_gathered
from kvasir.model.paged_inplace import RowPlan, attend_rows, slot_runs

BLOCK, BLOCKS, KV_HEADS, GROUPS, DIM = 4, 40, 2, 3, 8


def reference(row: RowPlan, query, k_cache, v_cache, window, scale):
    """[n, heads, dim]: every query of the row against its context, one softmax."""
    n = row.num_tokens
    slots = torch.tensor([row.table[p // BLOCK] * BLOCK + p % BLOCK for p in range(row.start + n)])
    keys, values = k_cache[slots], v_cache[slots]  # [context, kv_heads, dim]
    out = torch.empty(n, KV_HEADS * GROUPS, DIM)
    for i in range(n):
        position = row.start + i
        visible = [p for p in range(position + 1) if window is None or position - p < window]
        for h in range(KV_HEADS * GROUPS):
            q = query[h, row.begin + i]
            k, v = keys[visible, h // GROUPS], values[visible, h // GROUPS]
            out[i, h] = torch.softmax(k @ q * scale, dim=0) @ v
    return out


def batch(rng: random.Random, shapes: list[tuple[int, int]]):
    """Rows (start, n) with scattered block tables; the caches hold every row's context,
    this batch's keys written as the layer would."""
    free = list(range(BLOCKS))
    rng.shuffle(free)
    rows, begin = [], 0
    for start, n in shapes:
        need = -(-(start + n) // BLOCK)
        table = tuple(sorted(free[:need]) if rng.random() < 0.5 else free[:need])
        del free[:need]
        rows.append(RowPlan(begin, begin + n, start, table, BLOCK))
        begin += n
    k_cache = torch.randn(BLOCKS * BLOCK, KV_HEADS, DIM)
    v_cache = torch.randn(BLOCKS * BLOCK, KV_HEADS, DIM)
    query = torch.randn(KV_HEADS * GROUPS, begin, DIM)
    own = [(r, r.table[p // BLOCK] * BLOCK + p % BLOCK) for r in rows for p in range(r.start, r.start + r.num_tokens)]
    slots = torch.tensor([slot for _, slot in own])
    return rows, query, k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1), (k_cache, v_cache)


@pytest.mark.parametrize("window", [None, 1, 5, 9])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_in_place_and_gathered_attention_equal_a_plain_softmax(window, seed):
    rng = random.Random(seed)
    # decode rows (n = 1) at various positions, chunks from the start and from mid-prompt
    shapes = [(0, 1), (13, 1), (30, 1), (0, 7), (9, 6), (17, 12), (5, 1), (2, 3)]
    rows, query, key, value, caches = batch(rng, shapes)
    scale = DIM**-0.5
    expected = torch.cat([reference(row, query, *caches, window, scale) for row in rows])
    in_place = attend_rows(
        rows, query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), caches, window=window, scale=scale
    )
    gathered = attend_gathered(GatherPlan.of(rows, torch.device("cpu")), query, caches, window, scale, KV_HEADS)
    torch.testing.assert_close(in_place, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gathered, expected, atol=1e-5, rtol=1e-5)
    assert any(len(row.runs(None)) > 1 for row in rows), "some row should read several runs"


def test_runs_join_adjacent_blocks_and_refuse_positions_past_the_table():
    assert slot_runs((3, 4, 5, 9), 4, 0, 15) == [(12, 24), (36, 39)]
    assert slot_runs((3, 4, 5, 9), 4, 6, 10) == [(18, 22)]
    assert slot_runs((2,), 4, 0, 0) == []
    with pytest.raises(BatchError, match="position 8 is past"):
        slot_runs((2, 3), 4, 0, 9)
