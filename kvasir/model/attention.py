"""Paged KV attention, plugged into Hugging Face decoder layers through AttentionInterface.

Per-batch metadata is built once per batch (``PagedBatch``) and handed to the layers as
a call argument (``kvasir=...``), which transformers forwards to the attention
function; nothing is kept in module-level state.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvasir.model.kv_cache import PagedKVCache
from kvasir.wire.batch import Row

ATTENTION_NAME = "kvasir_paged"


def register_attention() -> None:
    """Make the paged attention available under ATTENTION_NAME (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention)


@dataclass
class RowView:
    """A multi-token row (a prefill chunk): where it sits in the packed tokens and the cache."""

    begin: int  # first token index in the packed batch
    end: int
    start: int  # position of the row's first token
    read_slots: torch.Tensor  # cache slots of positions [0, start + n)
    masks: dict[tuple[int | None, int], torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None, groups: int, device: torch.device) -> torch.Tensor:
        """Boolean [groups * n, context] mask (True = attend), repeated for the query
        heads that share one KV head (grouped-query attention)."""
        key = (window, groups)
        if key not in self.masks:
            n = self.end - self.begin
            q_pos = torch.arange(self.start, self.start + n, device=device)[:, None]
            k_pos = torch.arange(self.start + n, device=device)[None, :]
            allowed = k_pos <= q_pos
            if window is not None:
                allowed &= (q_pos - k_pos) < window
            self.masks[key] = allowed.repeat(groups, 1)
        return self.masks[key]


@dataclass
class DecodeGroup:
    """Every single-token row of a batch, attended together in one padded call."""

    tokens: torch.Tensor  # [R] packed index of each row's token
    read_slots: torch.Tensor  # [R, L] cache slots of each row's context, padded with slot 0
    contexts: list[int]  # each row's context length (its position + 1)
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """Boolean [R, 1, 1, L] mask hiding padding and keys outside the window; None
        where every key of every row is attended."""
        if window not in self.masks:
            longest = self.read_slots.shape[1]
            if min(self.contexts) == longest and (window is None or longest <= window):
                self.masks[window] = None
            else:
                q_pos = torch.tensor(self.contexts, device=device)[:, None] - 1
                k_pos = torch.arange(longest, device=device)[None, :]
                allowed = k_pos <= q_pos
                if window is not None:
                    allowed &= (q_pos - k_pos) < window
                self.masks[window] = allowed[:, None, None, :]
        return self.masks[window]


@dataclass
class PagedBatch:
    """Attention metadata for one packed batch on one stage."""

    cache: PagedKVCache
    first_layer: int
    positions: torch.Tensor  # [T] position of every packed token
    write_slots: torch.Tensor  # [T] cache slot each token's K/V goes to
    decode: DecodeGroup | None  # the single-token rows
    chunks: list[RowView]  # the multi-token rows
    emit_index: torch.Tensor  # [E] packed index of each emitting row's last token
    score_index: torch.Tensor  # [S] packed index of every token of the scored rows (prompt log-probabilities)


def build_batch(
    cache: PagedKVCache, first_layer: int, rows: tuple[Row, ...], scored: Collection[int] = ()
) -> PagedBatch:
    """Record the rows' block growth and precompute every index the layers need; the rows
    of the requests in ``scored`` get logits at every token (the tail only)."""
    device = cache.keys.device
    positions, writes, chunks, emit = [], [], [], []
    score: list[int] = []
    singles: list[tuple[int, torch.Tensor]] = []
    begin = 0
    for row in rows:
        table = cache.extend(row.request_id, row.new_blocks)
        stop = row.start + row.num_tokens
        writes.append(cache.slots(row.request_id, table, row.start, stop))
        context = cache.slots(row.request_id, table, 0, stop)
        if row.num_tokens == 1:
            singles.append((begin, context))
        else:
            chunks.append(RowView(begin, begin + row.num_tokens, row.start, context))
        positions.append(torch.arange(row.start, stop))
        if row.request_id in scored:
            score.extend(range(begin, begin + row.num_tokens))
        begin += row.num_tokens
        if row.emit:
            emit.append(begin - 1)
    decode = None
    if singles:
        padded = torch.nn.utils.rnn.pad_sequence([slots for _, slots in singles], batch_first=True)
        decode = DecodeGroup(
            tokens=torch.tensor([index for index, _ in singles], dtype=torch.long, device=device),
            read_slots=padded,
            contexts=[len(slots) for _, slots in singles],
        )
    return PagedBatch(
        cache=cache,
        first_layer=first_layer,
        positions=torch.cat(positions).to(device),
        write_slots=torch.cat(writes),
        decode=decode,
        chunks=chunks,
        emit_index=torch.tensor(emit, dtype=torch.long, device=device),
        score_index=torch.tensor(score, dtype=torch.long, device=device),
    )


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    kvasir: PagedBatch | None = None,
    **_: object,
) -> tuple[torch.Tensor, None]:
    """Write this batch's K/V into the paged cache, then attend over it: every
    single-token row in one padded call, each multi-token row on its own.

    ``query`` is [1, heads, T, dim] and ``key``/``value`` are [1, kv_heads, T, dim]
    (rotary already applied); returns [1, T, heads, dim]. Query heads that share a KV
    head are folded into the query length instead of copying the keys per head.
    """
    if kvasir is None:
        raise RuntimeError("kvasir_paged attention called without its batch metadata (kvasir=...)")
    layer = cast(int, module.layer_idx) - kvasir.first_layer
    k_cache = kvasir.cache.keys[layer]
    v_cache = kvasir.cache.values[layer]
    k_cache.index_copy_(0, kvasir.write_slots, key[0].transpose(0, 1))
    v_cache.index_copy_(0, kvasir.write_slots, value[0].transpose(0, 1))
    heads, total, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    out = query.new_empty(total, heads, dim)
    decode = kvasir.decode
    if decode is not None:
        rows = decode.tokens.shape[0]
        q = query[0].index_select(1, decode.tokens).transpose(0, 1).reshape(rows, kv_heads, groups, dim)
        k = k_cache[decode.read_slots].transpose(1, 2)  # [R, kv_heads, L, dim]
        v = v_cache[decode.read_slots].transpose(1, 2)
        mask = decode.mask(sliding_window, query.device)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
        out.index_copy_(0, decode.tokens, attended.reshape(rows, heads, dim))
    for row in kvasir.chunks:
        n = row.end - row.begin
        q = query[0, :, row.begin : row.end].reshape(kv_heads, groups * n, dim)
        k = k_cache[row.read_slots].transpose(0, 1)  # [kv_heads, context, dim]
        v = v_cache[row.read_slots].transpose(0, 1)
        mask = row.mask(sliding_window, groups, query.device)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
        out[row.begin : row.end] = attended.reshape(heads, n, dim).transpose(0, 1)
    return out.unsqueeze(0), None
