"""Paged KV attention, called by each layer's fused attention (kvasir/model/fused.py).

Per-batch metadata is built once per batch (``PagedBatch``) and handed to the layers as
a call argument; nothing is kept in module-level state. Each layer writes the batch's keys and
values into the cache, then attends: in place on CPU (kvasir/model/paged_inplace.py),
by gathering every row's context on an accelerator (kvasir/model/paged_gather.py).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from functools import cached_property

import torch

from kvasir.errors import BatchError
from kvasir.model.host_index import to_device
from kvasir.model.kv_cache import PagedKVCache, slot_list
from kvasir.model.paged_gather import GatherPlan, attend_gathered
from kvasir.model.paged_inplace import RowPlan, attend_rows
from kvasir.wire.batch import Row


@dataclass
class PagedBatch:
    """Attention metadata for one packed batch on one stage."""

    cache: PagedKVCache
    first_layer: int
    positions: torch.Tensor  # [T] position of every packed token
    write_slots: torch.Tensor  # [T] cache slot each token's K/V goes to
    rows: list[RowPlan]
    emit_index: torch.Tensor  # [E] packed index of every sampled position (an emitting row's last 1 + drafts tokens)
    score_index: torch.Tensor  # [S] packed index of every token of the scored rows (prompt log-probabilities)
    in_place: bool  # attend over the cache in place (CPU), else gather each row's context
    end: int  # one past the batch's largest position

    @cached_property
    def gathered(self) -> GatherPlan:
        return GatherPlan.of(self.rows, self.cache.keys.device)


def build_batch(
    cache: PagedKVCache, first_layer: int, rows: tuple[Row, ...], scored: Collection[int] = ()
) -> PagedBatch:
    """Record the rows' block growth and precompute every index the layers need; the rows
    of the requests in ``scored`` get logits at every token (the tail only). The indices
    are built on the host and reach an accelerator in one non-blocking copy
    (kvasir/model/host_index.py)."""
    positions: list[int] = []
    writes: list[int] = []
    plans = []
    emit: list[int] = []
    score: list[int] = []
    begin = end = 0
    for row in rows:
        if row.num_tokens < 1:
            raise BatchError(f"request {row.request_id}: a row of {row.num_tokens} tokens")
        if row.draft and (not row.emit or len(row.draft) >= row.num_tokens):
            raise BatchError(f"request {row.request_id}: {len(row.draft)} drafts in a row of {row.num_tokens} tokens")
        table = cache.extend(row.request_id, row.new_blocks)
        stop = row.start + row.num_tokens
        end = max(end, stop)
        writes += slot_list(row.request_id, table, cache.block_size, row.start, stop)
        plans.append(RowPlan(begin, begin + row.num_tokens, row.start, tuple(table), cache.block_size))
        positions.extend(range(row.start, stop))
        if row.request_id in scored:
            score.extend(range(begin, begin + row.num_tokens))
        begin += row.num_tokens
        emit.extend(range(begin - row.samples, begin))
    device = cache.keys.device
    at, slots, emits, scores = to_device(
        device, *(torch.tensor(values, dtype=torch.long) for values in (positions, writes, emit, score))
    )
    return PagedBatch(cache, first_layer, at, slots, plans, emits, scores, in_place=device.type == "cpu", end=end)


def attend(
    batch: PagedBatch,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    window: int | None,
    scale: float | None,
) -> torch.Tensor:
    """Write this batch's K/V of model layer ``layer_idx`` into the paged cache, then attend
    over it: ``query`` [T, heads, dim], ``key``/``value`` [T, kv_heads, dim] (rotary already
    applied); returns [T, heads, dim]."""
    caches = batch.cache.layer(layer_idx - batch.first_layer)
    caches[0].index_copy_(0, batch.write_slots, key)
    caches[1].index_copy_(0, batch.write_slots, value)
    if batch.in_place:
        return attend_rows(batch.rows, query, key, value, caches, window=window, scale=scale)
    return attend_gathered(batch.gathered, query.transpose(0, 1), caches, window, scale, key.shape[1])
