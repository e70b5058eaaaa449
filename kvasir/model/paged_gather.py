"""Attention over the paged KV cache by gathering: each row's keys are copied out of the
cache into a padded tensor, and every decode row is attended in one call.

The accelerator path (one kernel launch per layer for all decode rows; a per-row loop of
small launches would cost more than the copy). On CPU the in-place path
(kvasir/model/paged_inplace.py) is used instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvasir.model.host_index import to_device
from kvasir.model.kv_cache import flat_slots
from kvasir.model.paged_inplace import RowPlan


@dataclass
class ChunkView:
    """A multi-token row (a prefill chunk) with the cache slots of its whole context."""

    row: RowPlan
    read_slots: torch.Tensor  # cache slots of positions [0, start + n)
    masks: dict[tuple[int | None, int], torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None, groups: int, device: torch.device) -> torch.Tensor:
        """Boolean [groups * n, context] mask (True = attend), repeated for the query
        heads that share one KV head (grouped-query attention)."""
        key = (window, groups)
        if key not in self.masks:
            start, n = self.row.start, self.row.num_tokens
            q_pos = torch.arange(start, start + n, device=device)[:, None]
            k_pos = torch.arange(start + n, device=device)[None, :]
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
    lengths: torch.Tensor  # [R] the same, on the device
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """Boolean [R, 1, 1, L] mask hiding padding and keys outside the window; None
        where every key of every row is attended."""
        if window not in self.masks:
            longest = self.read_slots.shape[1]
            if min(self.contexts) == longest and (window is None or longest <= window):
                self.masks[window] = None
            else:
                q_pos = self.lengths[:, None] - 1
                k_pos = torch.arange(longest, device=device)[None, :]
                allowed = k_pos <= q_pos
                if window is not None:
                    allowed &= (q_pos - k_pos) < window
                self.masks[window] = allowed[:, None, None, :]
        return self.masks[window]


@dataclass
class GatherPlan:
    decode: DecodeGroup | None
    chunks: list[ChunkView]

    @classmethod
    def of(cls, rows: list[RowPlan], device: torch.device) -> GatherPlan:
        """Every row's context slots, built on the host and moved in one non-blocking copy."""
        singles: list[tuple[int, torch.Tensor]] = []
        chunks: list[tuple[RowPlan, torch.Tensor]] = []
        for row in rows:
            context = flat_slots(0, row.table, row.block_size, 0, row.start + row.num_tokens)
            if row.num_tokens == 1:
                singles.append((row.begin, context))
            else:
                chunks.append((row, context))
        host = [slots for _, slots in chunks]
        contexts = [len(slots) for _, slots in singles]
        if singles:
            host.append(torch.tensor([index for index, _ in singles], dtype=torch.long))
            host.append(torch.nn.utils.rnn.pad_sequence([slots for _, slots in singles], batch_first=True))
            host.append(torch.tensor(contexts, dtype=torch.long))
        moved = to_device(device, *host)
        decode = None
        if singles:
            tokens, read_slots, lengths = moved[len(chunks) :]
            decode = DecodeGroup(tokens, read_slots, contexts, lengths)
        return cls(decode, [ChunkView(row, slots) for (row, _), slots in zip(chunks, moved)])


def attend_gathered(
    plan: GatherPlan,
    query: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    window: int | None,
    scale: float | None,
    kv_heads: int,
) -> torch.Tensor:
    """[T, heads, dim] attention output; ``query`` [heads, T, dim]. Query heads that share a
    KV head are folded into the query length instead of copying the keys per head."""
    k_cache, v_cache = caches
    heads, total, dim = query.shape
    groups = heads // kv_heads
    out = query.new_empty(total, heads, dim)
    decode = plan.decode
    if decode is not None:
        rows = decode.tokens.shape[0]
        q = query.index_select(1, decode.tokens).transpose(0, 1).reshape(rows, kv_heads, groups, dim)
        k = k_cache[decode.read_slots].transpose(1, 2)  # [R, kv_heads, L, dim]
        v = v_cache[decode.read_slots].transpose(1, 2)
        mask = decode.mask(window, query.device)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out.index_copy_(0, decode.tokens, attended.reshape(rows, heads, dim))
    for chunk in plan.chunks:
        begin, end = chunk.row.begin, chunk.row.end
        q = query[:, begin:end].reshape(kv_heads, groups * (end - begin), dim)
        k = k_cache[chunk.read_slots].transpose(0, 1)  # [kv_heads, context, dim]
        v = v_cache[chunk.read_slots].transpose(0, 1)
        mask = chunk.mask(window, groups, query.device)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[begin:end] = attended.reshape(heads, end - begin, dim).transpose(0, 1)
    return out
