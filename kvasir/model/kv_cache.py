"""One stage's paged KV cache: preallocated blocks, and each request's block table.

The head decides which block ids a request uses (the same ids on every stage); a stage
only records the growth each row announces and frees a request's table on release.
"""

from __future__ import annotations

import torch

from kvasir.errors import BatchError
from kvasir.model.paged_inplace import slot_runs


class PagedKVCache:
    """Keys and values for ``num_layers`` layers in ``num_blocks`` blocks of ``block_size``."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        storage: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        shape = (num_layers, num_blocks * block_size, kv_heads, head_dim)
        if storage is None:
            self.keys = torch.zeros(shape, dtype=dtype, device=device)
            self.values = torch.zeros(shape, dtype=dtype, device=device)
        else:  # memory shared with other processes (a prefill stage's cache, read by decode stages)
            self.keys, self.values = storage
            if self.keys.shape != shape or self.values.shape != shape or self.keys.dtype != dtype:
                raise BatchError(f"KV storage of shape {tuple(self.keys.shape)} does not match {shape}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._tables: dict[int, list[int]] = {}
        self._layers = [(self.keys[i], self.values[i]) for i in range(num_layers)]  # views, made once

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of the stage's ``index``-th layer, [slots, kv_heads, head_dim] each."""
        return self._layers[index]

    @staticmethod
    def bytes_needed(
        num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_blocks * block_size * kv_heads * head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    @property
    def requests(self) -> int:
        return len(self._tables)

    @property
    def blocks_held(self) -> int:
        return sum(len(table) for table in self._tables.values())

    def release(self, request_ids: tuple[int, ...] | list[int]) -> None:
        for rid in request_ids:
            self._tables.pop(rid, None)

    def table(self, request_id: int) -> list[int]:
        """A request's block table ([] if the stage holds none)."""
        return self._tables.get(request_id, [])

    def extend(self, request_id: int, new_blocks: tuple[int, ...]) -> list[int]:
        """Record a row's block growth and return the request's whole table."""
        for block in new_blocks:
            if not 0 <= block < self.num_blocks:
                raise BatchError(f"request {request_id}: block id {block} outside [0, {self.num_blocks})")
        table = self._tables.setdefault(request_id, [])
        table.extend(new_blocks)
        return table

    def slots(self, request_id: int, table: list[int] | tuple[int, ...], start: int, stop: int) -> torch.Tensor:
        """Flat cache slots of positions [start, stop) of a request."""
        return flat_slots(request_id, table, self.block_size, start, stop).to(self.keys.device)


def slot_list(request_id: int, table, block_size: int, start: int, stop: int) -> list[int]:
    """Flat slots of positions [start, stop) in a cache of ``block_size`` blocks, given a
    block table (Python ints: a decode row's one slot costs no tensor operations)."""
    if start < 0:
        raise BatchError(f"request {request_id}: negative position {start}")
    if stop > len(table) * block_size:
        raise BatchError(f"request {request_id}: position {stop - 1} is past its {len(table)} KV blocks")
    slots: list[int] = []
    for lo, hi in slot_runs(table, block_size, start, stop):
        slots.extend(range(lo, hi))
    return slots


def flat_slots(request_id: int, table, block_size: int, start: int, stop: int) -> torch.Tensor:
    """``slot_list`` as a tensor."""
    return torch.tensor(slot_list(request_id, table, block_size, start, stop), dtype=torch.long)
