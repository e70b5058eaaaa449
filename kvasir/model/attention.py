"""Paged KV attention, plugged into Hugging Face decoder layers through AttentionInterface.

Per-batch metadata is built once per batch (``PagedBatch``) and handed to the layers as
a call argument (``kvasir=...``), which transformers forwards to the attention
function; nothing is kept in module-level state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvasir.messages import Row
from kvasir.model.kv_cache import PagedKVCache

ATTENTION_NAME = "kvasir_paged"


def register_attention() -> None:
    """Make the paged attention available under ATTENTION_NAME (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention)


@dataclass
class RowView:
    """Where one row sits in the packed tokens and in the cache."""

    begin: int  # first token index in the packed batch
    end: int
    start: int  # position of the row's first token
    read_slots: torch.Tensor  # cache slots of positions [0, start + n)
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """Boolean [n, context] mask (True = attend), None where plain attention is exact."""
        if window not in self.masks:
            n, context = self.end - self.begin, self.start + self.end - self.begin
            if n == 1 and (window is None or context <= window):
                self.masks[window] = None
            else:
                q_pos = torch.arange(self.start, self.start + n, device=device)[:, None]
                k_pos = torch.arange(context, device=device)[None, :]
                allowed = k_pos <= q_pos
                if window is not None:
                    allowed &= (q_pos - k_pos) < window
                self.masks[window] = allowed
        return self.masks[window]


@dataclass
class PagedBatch:
    """Attention metadata for one packed batch on one stage."""

    cache: PagedKVCache
    first_layer: int
    positions: torch.Tensor  # [T] position of every packed token
    write_slots: torch.Tensor  # [T] cache slot each token's K/V goes to
    rows: list[RowView]
    emit_index: torch.Tensor  # [E] packed index of each emitting row's last token


def build_batch(cache: PagedKVCache, first_layer: int, rows: tuple[Row, ...]) -> PagedBatch:
    """Record the rows' block growth and precompute every index the layers need."""
    device = cache.keys.device
    positions, writes, views, emit = [], [], [], []
    begin = 0
    for row in rows:
        table = cache.extend(row.request_id, row.new_blocks)
        stop = row.start + row.num_tokens
        writes.append(cache.slots(row.request_id, table, row.start, stop))
        views.append(RowView(begin, begin + row.num_tokens, row.start, cache.slots(row.request_id, table, 0, stop)))
        positions.append(torch.arange(row.start, stop))
        begin += row.num_tokens
        if row.emit:
            emit.append(begin - 1)
    return PagedBatch(
        cache=cache,
        first_layer=first_layer,
        positions=torch.cat(positions).to(device),
        write_slots=torch.cat(writes),
        rows=views,
        emit_index=torch.tensor(emit, dtype=torch.long, device=device),
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
    """Write this batch's K/V into the paged cache, then attend row by row over it.

    ``query`` is [1, heads, T, dim] and ``key``/``value`` are [1, kv_heads, T, dim]
    (rotary already applied); returns [1, T, heads, dim].
    """
    if kvasir is None:
        raise RuntimeError("kvasir_paged attention called without its batch metadata (kvasir=...)")
    layer = module.layer_idx - kvasir.first_layer
    k_cache = kvasir.cache.keys[layer]
    v_cache = kvasir.cache.values[layer]
    k_cache.index_copy_(0, kvasir.write_slots, key[0].transpose(0, 1))
    v_cache.index_copy_(0, kvasir.write_slots, value[0].transpose(0, 1))
    groups = query.shape[1] // key.shape[1]
    outputs = []
    for row in kvasir.rows:
        q = query[:, :, row.begin : row.end, :]
        k = k_cache[row.read_slots].permute(1, 0, 2).unsqueeze(0)
        v = v_cache[row.read_slots].permute(1, 0, 2).unsqueeze(0)
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        mask = row.mask(sliding_window, query.device)
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None
