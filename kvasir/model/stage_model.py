"""One stage's forward pass over a packed batch.

Whether the stage embeds token ids (head) and whether it ends in logits (tail) is
chosen once at construction; the forward pass itself never branches on topology. Each
layer runs as kvasir/model/decoder.py says, on transformers' modules.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvasir.model.attention import PagedBatch
from kvasir.model.decoder import LayerRun, RotaryTables, decoder_layer, rms_norm
from kvasir.model.loader import SliceModules
from kvasir.model.source import ModelSource


class StageModel(nn.Module):
    """A contiguous slice of decoder layers with the head's or tail's extras."""

    def __init__(self, modules: SliceModules, source: ModelSource, device: torch.device, max_seq_len: int) -> None:
        super().__init__()
        self.slice = modules
        self.dtype = next(modules.parameters()).dtype
        with torch.device(device):
            # Rotary tables are computed, not loaded: made once on the device, in the stage's dtype.
            self.rotary = RotaryTables(
                modules.rotary_type(config=source.fresh_config()), self.dtype, device, max_seq_len
            )
        self.runs = [LayerRun.of(layer) for layer in modules.layers]  # the weights are final: loaded, fused, packed
        self._enter: Callable[[torch.Tensor], torch.Tensor] = (
            self._embed if modules.embed_tokens is not None else self._hidden
        )
        self._exit: Callable[[torch.Tensor, PagedBatch], torch.Tensor] = (
            self._logits if modules.lm_head is not None else self._boundary
        )

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """Token ids [T] (head) or boundary [T, hidden] in; boundary or logits [E, vocab] out."""
        hidden = self._enter(inputs)
        rope = self.rotary(hidden, batch.positions, batch.end)
        for layer in self.runs:
            hidden = decoder_layer(layer, hidden, rope, batch)
        return self._exit(hidden, batch)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.slice.embed_tokens(token_ids)

    def _hidden(self, boundary: torch.Tensor) -> torch.Tensor:
        return boundary.to(self.dtype)

    def _logits(self, hidden: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """[E + S, vocab]: every sampled position (each emitting row's last token, or its
        last 1 + drafts), then every scored token."""
        index = batch.emit_index
        if batch.score_index.numel():
            index = torch.cat([index, batch.score_index])
        last = hidden.index_select(0, index)
        return self.slice.lm_head(rms_norm(self.slice.norm, last)).float()

    def _boundary(self, hidden: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        return hidden
