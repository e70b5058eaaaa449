"""What a stage does in the pool its instance serves, and what it keeps whichever pool
that is.

``PoolParts`` (kvasir/stage/ports.py) are a pool's: the head's intake (a colocated or
mixed ring's, a prefill head's, a decode head's), the tail's outlet (a prefill tail
hands requests on) and the hand-off role (a prefill stage announces K/V, a decode stage
receives it). ``Kept`` is the rest: the engine (weights, the KV cache, which is the same
in every pool), the head's scheduler (its blocks and prefix cache), the tail's sampler
and the middle of the ring (its edges are sized for every pool's widths).

A moving instance's stages, once it holds no request (kvasir/bridge/moves.py), are each
sent a ``regroup`` command with their ring's plan in the new pool: ``Regrouper`` checks
it against what the stage runs, then builds the new pool's parts on what it kept, and
the stage says Ready again. No process restarts and no weight is read again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import msgspec
import zmq

from kvasir.errors import BatchError, KvasirError
from kvasir.model.source import ModelSource
from kvasir.sched.scheduler import Scheduler
from kvasir.sched.speculation import Drafter
from kvasir.stage.decode_head import DecodeHeadIntake
from kvasir.stage.drafting import model_drafter
from kvasir.stage.engine import StageEngine
from kvasir.stage.grammar import Grammars
from kvasir.stage.handoff import HandoffSender, KvReceiver, NoHandoff, overlap
from kvasir.stage.heads import PrefillHeadIntake, SchedulerIntake, answer_load
from kvasir.stage.kv_remote import KvInbox, KvStream
from kvasir.stage.outlets import PrefillTailOutlet, TailOutlet
from kvasir.stage.pooling import LoadWaits
from kvasir.stage.ports import HandoffRole, Intake, Outlet, PoolParts, RegroupError
from kvasir.stage.sampling import Sampler
from kvasir.stage.wiring import Wiring
from kvasir.transport.channels import PushChannel
from kvasir.wire.control import Command, StageSettings
from kvasir.wire.head import HeadMessage, PoolLoaded
from kvasir.wire.kv import KvMessage


@dataclass
class Kept:
    """What a stage keeps whichever pool it serves."""

    engine: StageEngine
    source: ModelSource
    bridge: PushChannel
    upstream: Intake | None = None  # a stage after the head: the previous stage's descriptors
    downstream: Outlet | None = None  # a stage before the tail: the next stage's slots
    scheduler: Scheduler | None = None  # the head
    loads: LoadWaits | None = None  # the head, with [kv_pool]: its stages' word on pool loads
    drafter: Drafter | None = None  # the head, where a decoding pool drafts with a model
    sampler: Sampler | None = None  # the tail

    def pool_loaded(self, message: PoolLoaded) -> None:
        """The head's own stage read back (some of) a loading request's pool blocks."""
        if self.scheduler is not None:
            answer_load(self.loads, self.scheduler, message)


def keep_head(w: Wiring, kept: Kept) -> None:
    """The head's scheduler (for the pool it starts in), its drafter and pool loads."""
    settings, plan = w.settings, w.settings.plan
    decoding = settings.pool != "prefill"
    kept.drafter = model_drafter(plan, kept.engine.device, drafting=decoding)
    kept.scheduler = Scheduler(plan, kept.source.vocab_size, reserve_output=decoding, drafter=kept.drafter)
    if plan.kv_pool is not None:
        stages = range(settings.first, settings.first + len(plan.stages))
        kept.loads = LoadWaits(stages, plan.kv_pool.load_timeout_s)


def keep_tail(w: Wiring, kept: Kept) -> None:
    source, plan = kept.source, w.settings.plan
    grammars = Grammars(source.weights_dir, source.vocab_size)
    kept.sampler = Sampler(source.eos_token_ids, plan.model.max_seq_len, grammars, speculative=_drafts(w.settings))


def _drafts(settings: StageSettings) -> bool:
    """Its tail reports drafts' fate: the plan drafts and the pool decodes."""
    return settings.plan.speculative is not None and settings.pool != "prefill"


def pool_parts(w: Wiring, kept: Kept) -> PoolParts:
    """The parts of the pool ``w.settings`` names, on what the stage keeps."""
    intake = _head_intake(w, kept) if w.local == 0 else kept.upstream
    outlet = _tail_outlet(w, kept) if w.local == w.last else kept.downstream
    if intake is None or outlet is None:
        raise KvasirError(f"stage {w.settings.index} was built without its ring's ends")
    return PoolParts(w.settings, intake, outlet, _handoff(w, kept.engine))


class Regrouper:
    """A stage's answer to ``regroup``: the new pool's parts (kvasir/stage/agent.py swaps them in)."""

    def __init__(self, wiring: Wiring, kept: Kept, parts: PoolParts) -> None:
        self.wiring = wiring
        self.kept = kept
        self.parts = parts

    def __call__(self, command: Command) -> PoolParts:
        """Raises RegroupError, changing nothing, when the command does not fit this stage
        or its head still holds a request."""
        settings = self._settings(command)
        kept, decoding = self.kept, settings.pool != "prefill"
        if kept.scheduler is not None:
            if decoding and kept.drafter is None:
                kept.drafter = model_drafter(settings.plan, kept.engine.device)
            try:
                kept.scheduler.regroup(settings.plan, decoding, kept.drafter)
            except BatchError as exc:
                raise RegroupError(str(exc)) from None
        if kept.sampler is not None:
            kept.sampler.speculative = _drafts(settings)
        self.parts.handoff.close()
        self.wiring = replace(self.wiring, settings=settings)
        self.parts = pool_parts(self.wiring, kept)
        return self.parts

    def _settings(self, command: Command) -> StageSettings:
        old = self.wiring.settings
        plan, pool = command.plan, command.pool
        if plan is None or pool is None:
            raise RegroupError("a regroup command without its pool and plan")
        if msgspec.structs.replace(plan, batch=old.plan.batch) != old.plan:
            raise RegroupError(f"the {pool or 'mixed'} pool's plan differs from this stage's in more than its widths")
        too_wide = [e.name for e in old.edges if plan.batch.max_tokens > e.max_tokens or plan.batch.inflight > e.slots]
        if too_wide:
            raise RegroupError(f"the {pool or 'mixed'} pool's widths do not fit edge {too_wide[0]}")
        if pool and old.handoff is None:
            raise RegroupError(f"stage {old.index} has no hand-off wiring: it cannot serve the {pool} pool")
        return msgspec.structs.replace(old, pool=pool, plan=plan)

    def close(self) -> None:
        self.parts.handoff.close()


def _head_intake(w: Wiring, kept: Kept) -> Intake:
    settings, ends, scheduler = w.settings, w.ends, kept.scheduler
    if scheduler is None:
        raise KvasirError(f"stage {settings.index} is a head without its scheduler")
    inbox = w.pull(HeadMessage, ends.stage_in(settings.index))
    if settings.pool == "prefill":
        decoders = _heads(w, w.others(w.handoff.decode_heads))
        return PrefillHeadIntake(scheduler, inbox, kept.bridge, decoders, w.handoff.lease_s)
    if settings.pool == "decode":
        mine = range(settings.first, settings.first + len(settings.plan.stages))
        stages = [w.push(KvMessage, ends.kv_in(k)) for k in mine]
        return DecodeHeadIntake(scheduler, inbox, kept.bridge, _heads(w, w.others(w.handoff.prefill_heads)), stages)
    return SchedulerIntake(scheduler, inbox, kept.bridge, kept.loads)


def _tail_outlet(w: Wiring, kept: Kept) -> Outlet:
    settings, sampler = w.settings, kept.sampler
    if sampler is None:
        raise KvasirError(f"stage {settings.index} is a tail without its sampler")
    head = w.push(HeadMessage, w.ends.stage_in(w.head))
    if settings.pool == "prefill":
        decoders = _heads(w, w.others(w.handoff.decode_heads))
        return PrefillTailOutlet(sampler, head, kept.bridge, decoders, settings.first)
    return TailOutlet(sampler, head, kept.bridge)


def _heads(w: Wiring, heads: list[int]) -> dict[int, PushChannel]:
    """Push channels to other instances' heads, by their global index."""
    return {head: w.push(HeadMessage, w.ends.stage_in(head)) for head in heads}


def _handoff(w: Wiring, engine: StageEngine) -> HandoffRole:
    settings, ends = w.settings, w.ends
    layers = engine.spec.layers
    if settings.pool == "prefill":
        return _sender(w, engine)
    if settings.pool == "decode":
        inbox = KvInbox(w.pull(KvMessage, ends.kv_in(settings.index)), engine.cache, settings.plan.model.max_seq_len)
        head = w.push(HeadMessage, ends.stage_in(settings.first))
        return KvReceiver(
            settings.index, layers, engine.cache, w.handoff, inbox, head, expiry_s=settings.plan.handoff.lease_s
        )
    return NoHandoff()


def _sender(w: Wiring, engine: StageEngine) -> HandoffSender:
    """A prefill stage's hand-off: per decode instance, its stages sharing layers with this
    one (on this host: they copy from this stage's segment; elsewhere: streamed)."""
    wiring, layers, index = w.handoff, engine.spec.layers, w.settings.index
    heads = w.others(wiring.decode_heads)
    targets: dict[int, list[PushChannel]] = {head: [] for head in heads}
    streams: dict[int, list[KvStream]] = {head: [] for head in heads}
    for head in heads:
        for target in wiring.ring_of(head):
            span = overlap(layers, wiring.layers[target])
            if span is None:
                continue
            if wiring.hosts and wiring.hosts[target] != wiring.hosts[index]:
                socket = w.connect(zmq.PUSH, w.ends.kv_in(target))
                streams[head].append(KvStream(socket, engine.cache, layers, span))
            else:
                targets[head].append(w.push(KvMessage, w.ends.kv_in(target)))
    return HandoffSender(index, layers, engine.cache, targets, streams)
