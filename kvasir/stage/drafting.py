"""Speculative decoding's draft model (``[speculative] method = "draft"``): a smaller model
with the target's vocabulary, whole in the head's process, that proposes each decode
row's drafts by greedy decoding, so the head never waits on the ring for them.

It keeps a paged KV cache of its own (as many blocks as a stage's) and, per request, the
tokens whose K/V it holds. Each call catches every asked-for request up on the tokens it
has not seen (its prompt the first time, in chunks of ``CATCH_UP`` tokens a call; then
the tokens the ring confirmed since), then decodes ``count`` tokens greedily: one pass of
the draft model for every draft position, all the requests together. Drafts the ring
rejected are found by comparing its tokens with the request's (their K/V is overwritten
next time). A request the cache has no room for gets no drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvasir.config.devices import torch_dtype
from kvasir.config.plan import Plan
from kvasir.model.attention import build_batch
from kvasir.model.kv_cache import PagedKVCache
from kvasir.model.loader import SliceSpec, load_slice
from kvasir.model.packed import pack_linears
from kvasir.model.source import ModelSource, resolve_source
from kvasir.model.stage_model import StageModel
from kvasir.sched.blocks import BlockAllocator
from kvasir.sched.requests import RequestState
from kvasir.sched.speculation import history_after
from kvasir.wire.batch import Row

CATCH_UP = 256  # tokens of a request's history one call computes at most (a long prompt takes several)


@dataclass
class DraftRequest:
    """One request as the draft model holds it."""

    tokens: list[int] = field(default_factory=list)  # whose K/V it holds, in order
    history: list[int] = field(default_factory=list)  # the request's prompt (where known) and output
    blocks: list[int] = field(default_factory=list)
    sent: int = 0  # of its blocks, those the cache's table has


class ModelDrafter:
    def __init__(self, source: ModelSource, plan: Plan, device: torch.device) -> None:
        """``source``: the draft model; ``plan``: the target's (its dtype, cache geometry
        and context length)."""
        dtype = torch_dtype(plan.model.dtype)
        spec = SliceSpec(layers=(0, source.num_layers), is_head=True, is_tail=True)
        modules, _ = load_slice(source, spec, dtype, device, "dequantize")
        pack_linears(modules)
        self.model = StageModel(modules, source, device, plan.model.max_seq_len)
        self.max_seq_len = plan.model.max_seq_len
        self.cache = PagedKVCache(
            num_layers=source.num_layers,
            num_blocks=plan.kv.num_blocks,
            block_size=plan.kv.block_size,
            kv_heads=source.kv_heads,
            head_dim=source.head_dim,
            dtype=dtype,
            device=device,
        )
        self.blocks = BlockAllocator(plan.kv.num_blocks)
        self._requests: dict[int, DraftRequest] = {}

    def propose(self, wanted: list[tuple[RequestState, int]]) -> dict[int, list[int]]:
        ready: list[tuple[int, DraftRequest, int]] = []
        catching: list[tuple[int, DraftRequest]] = []
        for state, count in wanted:
            request = self._request(state)
            count = min(count, self.max_seq_len - len(request.history))
            behind = len(request.history) - len(request.tokens)  # >= 1: its newest token is never held yet
            if count <= 0 or behind <= 0 or not self._room(request, len(request.history) + count - 1):
                continue
            if behind > CATCH_UP:
                catching.append((state.request_id, request))
            else:
                ready.append((state.request_id, request, count))
        if catching:
            self._run([(rid, request, request.history[len(request.tokens) :][:CATCH_UP]) for rid, request in catching])
        return self._decode(ready) if ready else {}

    def forget(self, request_id: int) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.blocks.release(request.blocks)
            self.cache.release([request_id])

    def _request(self, state: RequestState) -> DraftRequest:
        """The request's draft-side state, its history brought up to its newest token and
        its held tokens cut back to where they agree with that history."""
        request = self._requests.setdefault(state.request_id, DraftRequest())
        request.history += history_after(state, len(request.history))
        agree = 0
        for held, actual in zip(request.tokens, request.history):
            if held != actual:
                break
            agree += 1
        del request.tokens[agree:]
        return request

    def _room(self, request: DraftRequest, positions: int) -> bool:
        """Blocks for its first ``positions`` positions, taken now if need be."""
        need = -(-positions // self.cache.block_size) - len(request.blocks)
        if need <= 0:
            return True
        taken = self.blocks.allocate(need)
        if taken is None:
            return False
        request.blocks += taken
        return True

    def _decode(self, ready: list[tuple[int, DraftRequest, int]]) -> dict[int, list[int]]:
        """Catch each request up and take its first draft, then one pass per further draft."""
        drafts: dict[int, list[int]] = {rid: [] for rid, _, _ in ready}
        feeds = [(rid, request, request.history[len(request.tokens) :]) for rid, request, _ in ready]
        for step in range(max(count for _, _, count in ready)):
            chosen = self._run(feeds)
            for rid, token in chosen.items():
                drafts[rid].append(token)
            feeds = [(rid, request, [drafts[rid][-1]]) for rid, request, count in ready if count > step + 1]
            if not feeds:
                break
        return drafts

    def _run(self, feeds: list[tuple[int, DraftRequest, list[int]]]) -> dict[int, int]:
        """One pass of the draft model over each request's next tokens; the greedy choice
        after each row that reaches the end of what the request has."""
        rows = []
        inputs: list[int] = []
        for rid, request, tokens in feeds:
            start = len(request.tokens)
            needed = -(-(start + len(tokens)) // self.cache.block_size)
            growth = tuple(request.blocks[request.sent : needed])
            request.sent = max(request.sent, needed)
            emit = start + len(tokens) >= len(request.history)
            rows.append(Row(rid, start, len(tokens), growth, emit=emit))
            request.tokens += tokens
            inputs += tokens
        batch = build_batch(self.cache, 0, tuple(rows))
        logits = self.model(torch.tensor(inputs, dtype=torch.long, device=self.cache.keys.device), batch)
        best = logits.argmax(dim=-1).tolist()
        return dict(zip((row.request_id for row in rows if row.emit), best))


def model_drafter(plan: Plan, device: torch.device, drafting: bool = True) -> ModelDrafter | None:
    """A head's draft model, where its plan drafts with one (``drafting`` False: a prefill
    pool's head, which does not draft)."""
    spec = plan.speculative
    if spec is None or spec.method != "draft" or spec.draft_model is None or not drafting:
        return None
    return ModelDrafter(resolve_source(spec.draft_model), plan, device)
