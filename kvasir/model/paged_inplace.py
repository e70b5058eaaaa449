"""Attention over the paged KV cache in place: no row's keys are copied out of the cache.

A row's cached keys are read as views of the cache, one per *run* (a stretch of its
block table whose block ids follow each other, so its slots are adjacent in memory); the
head hands each request one contiguous run of blocks whenever it can
(kvasir/sched/blocks.py), so a row usually reads one view. Each view is attended with
torch's CPU flash kernel, which also returns each query's log-sum-exp; the parts of a
row that reads several views (and of a prefill chunk, whose own new keys are attended
straight from the layer's projections, causally) are merged exactly with those.

Measured on the 2-core development machine (docs/bench/targets.md): 16 decode rows of 192
tokens, one layer of the default model, 0.53 ms against 1.97 ms for gathering every
row's slots into a padded copy and attending that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvasir.errors import BatchError

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass
class RowPlan:
    """One row of a packed batch: where its tokens sit, and the request's block table."""

    begin: int  # first token index in the packed batch
    end: int
    start: int  # position of the row's first token
    table: tuple[int, ...]
    block_size: int
    _runs: dict[int | None, list[tuple[int, int]]] = field(default_factory=dict)
    _masks: dict[tuple[int | None, int], list[Mask | None]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.end - self.begin

    def cached_span(self, window: int | None) -> tuple[int, int]:
        """Positions [low, high) of the keys read from the cache: a decode row's whole
        context (its own key is written already), a chunk's prefix before it."""
        high = self.start + 1 if self.num_tokens == 1 else self.start
        low = 0 if window is None else max(0, self.start - window + 1)  # what the first query sees
        return low, high

    def runs(self, window: int | None) -> list[tuple[int, int]]:
        """Flat cache slots [lo, hi) of the cached keys, one range per run of adjacent blocks."""
        if window not in self._runs:
            self._runs[window] = slot_runs(self.table, self.block_size, *self.cached_span(window))
        return self._runs[window]

    def masks(self, window: int | None, groups: int, dtype: torch.dtype) -> list[Mask | None]:
        """A chunk's additive masks, one per cached run and last its own keys' (causal);
        None where every query sees every key of the part."""
        key = (window, groups)
        if key not in self._masks:
            low, _ = self.cached_span(window)
            queries = torch.arange(self.start, self.start + self.num_tokens)[:, None]
            parts: list[Mask | None] = []
            position = low
            for lo, hi in self.runs(window):
                keys = torch.arange(position, position + hi - lo)[None, :]
                position += hi - lo
                parts.append(_mask(queries, keys, window, groups, dtype, causal=False))
            keys = torch.arange(self.start, self.start + self.num_tokens)[None, :]
            parts.append(_mask(queries, keys, window, groups, dtype, causal=True))
            self._masks[key] = parts
        return self._masks[key]


def slot_runs(table: tuple[int, ...], block_size: int, low: int, high: int) -> list[tuple[int, int]]:
    """The flat slots of positions [low, high) under ``table``, as ranges of adjacent slots."""
    if high > len(table) * block_size:
        raise BatchError(f"position {high - 1} is past the request's {len(table)} KV blocks")
    runs: list[tuple[int, int]] = []
    position = low
    while position < high:
        index, offset = divmod(position, block_size)
        take = min(block_size - offset, high - position)
        lo = table[index] * block_size + offset
        if runs and runs[-1][1] == lo:
            runs[-1] = (runs[-1][0], lo + take)
        else:
            runs.append((lo, lo + take))
        position += take
    return runs


@dataclass(frozen=True)
class Mask:
    additive: torch.Tensor  # [groups * n, keys]: 0 where a query attends a key, -inf where not
    blind: torch.Tensor  # [groups * n]: queries that see no key of the part
    any_blind: bool


def _mask(
    queries: torch.Tensor, keys: torch.Tensor, window: int | None, groups: int, dtype: torch.dtype, causal: bool
) -> Mask | None:
    """The mask of one part (query heads sharing a KV head repeat it), None when nothing is hidden."""
    allowed = keys <= queries if causal else torch.ones(queries.shape[0], keys.shape[1], dtype=torch.bool)
    if window is not None:
        allowed = allowed & (queries - keys < window)
    if bool(allowed.all()):
        return None
    additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf")).repeat(groups, 1)
    blind = ~allowed.any(dim=-1).repeat(groups)
    return Mask(additive, blind, bool(blind.any()))


def attend_rows(
    rows: list[RowPlan],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    *,
    window: int | None,
    scale: float | None,
) -> torch.Tensor:
    """[T, heads, dim] attention output of every row; ``query`` [T, heads, dim], ``key`` and
    ``value`` [T, kv_heads, dim] (this batch's own, already written to ``caches``).

    A decode row's one query is viewed as its heads grouped by KV head and each cached
    run as ``[1, kv_heads, keys, dim]`` without copying (each tensor operation costs a few
    microseconds, which a lone request pays per layer per token)."""
    heads, dim = query.shape[1], query.shape[2]
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    outs = []
    for row in rows:
        n = row.num_tokens
        sources = [(_run(caches[0], lo, hi), _run(caches[1], lo, hi)) for lo, hi in row.runs(window)]
        if n == 1:
            q = query[row.begin : row.end].view(1, kv_heads, groups, dim)
            parts = [_flash(q, k, v, scale=scale) for k, v in sources]
            outs.append(_merge(parts).reshape(1, heads, dim))
            continue
        # a chunk: its cached prefix, then its own keys
        own = slice(row.begin, row.end)
        q = query[own].transpose(0, 1).reshape(1, kv_heads, groups * n, dim)
        sources.append((key[own].transpose(0, 1)[None], value[own].transpose(0, 1)[None]))
        masks = row.masks(window, groups, q.dtype)
        parts = [_attend(q, k, v, mask, scale) for (k, v), mask in zip(sources, masks, strict=True)]
        outs.append(_merge(parts).reshape(heads, n, dim).transpose(0, 1))  # from [1, kv_heads, groups * n, dim]
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _run(cache: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Cache slots [lo, hi) of ``cache`` [slots, kv_heads, dim] as a [1, kv_heads, hi - lo, dim]
    view (one operation: slicing, transposing and adding the batch axis would be three)."""
    _, kv_heads, dim = cache.shape
    row, head, _ = cache.stride()
    return cache.as_strided((1, kv_heads, hi - lo, dim), (0, head, row, 1), cache.storage_offset() + lo * row)


def _attend(q, k, v, mask: Mask | None, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention of one part; a query that sees no key of the part gets log-sum-exp
    -inf (the kernel reports 0 there), so the merge gives the part no weight for it."""
    if mask is None:
        return _flash(q, k, v, scale=scale)
    out, lse = _flash(q, k, v, attn_mask=mask.additive, scale=scale)
    return out, lse.masked_fill(mask.blind, float("-inf")) if mask.any_blind else lse


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine attention over disjoint key sets by their log-sum-exps."""
    if len(parts) == 1:
        return parts[0][0]
    weights = torch.softmax(torch.stack([part[1] for part in parts]), dim=0).unsqueeze(-1)  # [P, 1, kv_heads, q, 1]
    outs = torch.stack([part[0].float() for part in parts])
    return (weights * outs).sum(dim=0).to(parts[0][0].dtype)
