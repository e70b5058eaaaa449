"""Paged KV attention, plugged into Hugging Face decoder layers through AttentionInterface.

Per-batch metadata is built once per batch (``PagedBatch``) and handed to the layers as
a call argument (``kvasir=...``), which transformers forwards to the attention
function; nothing is kept in module-level state. Each layer writes the batch's keys and
values into the cache, then attends: in place on CPU (kvasir/model/paged_inplace.py),
by gathering every row's context on an accelerator (kvasir/model/paged_gather.py).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from functools import cached_property
from typing import cast

import torch
from transformers import AttentionInterface

from kvasir.errors import BatchError
from kvasir.model.host_index import to_device
from kvasir.model.kv_cache import PagedKVCache, flat_slots
from kvasir.model.paged_gather import GatherPlan, attend_gathered
from kvasir.model.paged_inplace import RowPlan, attend_rows
from kvasir.wire.batch import Row

ATTENTION_NAME = "kvasir_paged"


def register_attention() -> None:
    """Make the paged attention available under ATTENTION_NAME (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention)


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
    positions, writes, plans = [], [], []
    emit: list[int] = []
    score: list[int] = []
    begin = 0
    for row in rows:
        if row.draft and (not row.emit or len(row.draft) >= row.num_tokens):
            raise BatchError(f"request {row.request_id}: {len(row.draft)} drafts in a row of {row.num_tokens} tokens")
        table = cache.extend(row.request_id, row.new_blocks)
        stop = row.start + row.num_tokens
        writes.append(flat_slots(row.request_id, table, cache.block_size, row.start, stop))
        plans.append(RowPlan(begin, begin + row.num_tokens, row.start, tuple(table), cache.block_size))
        positions.append(torch.arange(row.start, stop))
        if row.request_id in scored:
            score.extend(range(begin, begin + row.num_tokens))
        begin += row.num_tokens
        emit.extend(range(begin - row.samples, begin))
    device = cache.keys.device
    at, slots, emits, scores = to_device(
        device,
        torch.cat(positions),
        torch.cat(writes),
        torch.tensor(emit, dtype=torch.long),
        torch.tensor(score, dtype=torch.long),
    )
    return PagedBatch(cache, first_layer, at, slots, plans, emits, scores, in_place=device.type == "cpu")


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    kvasir: PagedBatch | None = None,
    **_: object,
) -> tuple[torch.Tensor, None]:
    """Write this batch's K/V into the paged cache, then attend over it.

    ``query`` is [1, heads, T, dim] and ``key``/``value`` are [1, kv_heads, T, dim]
    (rotary already applied); returns [1, T, heads, dim].
    """
    if kvasir is None:
        raise RuntimeError("kvasir_paged attention called without its batch metadata (kvasir=...)")
    layer = cast(int, module.layer_idx) - kvasir.first_layer
    caches = (kvasir.cache.keys[layer], kvasir.cache.values[layer])
    caches[0].index_copy_(0, kvasir.write_slots, key[0].transpose(0, 1))
    caches[1].index_copy_(0, kvasir.write_slots, value[0].transpose(0, 1))
    if kvasir.in_place:
        out = attend_rows(kvasir.rows, query[0], key[0], value[0], caches, window=sliding_window, scale=scaling)
    else:
        out = attend_gathered(kvasir.gathered, query[0], caches, sliding_window, scaling, key.shape[1])
    return out.unsqueeze(0), None
