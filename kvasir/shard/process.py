"""The expert shard process: load this shard's experts for its stage's MoE layers, map
its dispatch slot, open its sockets, then run the agent."""

from __future__ import annotations

import os
import signal

import torch
import zmq

from kvasir.config.devices import cuda_ordinal, torch_dtype
from kvasir.logs import setup_logging
from kvasir.model.loader import load_experts
from kvasir.model.pinning import pin_process
from kvasir.model.source import resolve_source
from kvasir.ring.expert_slots import DispatchSegment
from kvasir.shard.agent import ShardAgent, ShardPorts
from kvasir.transport.channels import PullChannel, PushChannel
from kvasir.transport.fabric import Sockets, open_fabric
from kvasir.wire.bridge import BridgeMessage
from kvasir.wire.control import Command, ControlMessage, Ready, ShardSettings
from kvasir.wire.experts import ExpertMessage


def build_agent(settings: ShardSettings, sockets: Sockets, log) -> tuple[ShardAgent, DispatchSegment]:
    wiring = settings.wiring
    ends = sockets.ends
    source = resolve_source(settings.plan.model.source)
    dtype = torch_dtype(settings.plan.model.dtype)
    ordinal = cuda_ordinal(wiring.spec.device)
    device = torch.device("cpu") if ordinal is None else torch.device("cuda", ordinal)
    bank = load_experts(source, wiring.layers, wiring.experts, dtype, device)
    moe = source.moe
    weights_dtype = torch.float32 if moe is None or moe.float32_weights else dtype
    slot = DispatchSegment(wiring.slot, create=False, side="shard")

    def push(kind, endpoint: str) -> PushChannel:
        return PushChannel[kind](sockets.connect(zmq.PUSH, endpoint))

    def pull(kind, endpoint: str) -> PullChannel:
        return PullChannel[kind](sockets.bind(zmq.PULL, endpoint), kind, log)

    ports = ShardPorts(
        work=pull(ExpertMessage, ends.shard_in(wiring.number)),
        results=push(ExpertMessage, ends.experts_out(wiring.stage)),
        commands=pull(Command, ends.command(f"shard-{wiring.number}")),
        bridge=push(BridgeMessage, ends.bridge_in),
        control=push(ControlMessage, ends.control),
    )
    return ShardAgent(settings, bank, slot, ports, weights_dtype=weights_dtype, log=log), slot


def run_shard(settings: ShardSettings) -> None:
    """Entry point of an expert shard process (spawned by the launcher)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the launcher owns shutdown
    wiring = settings.wiring
    log = setup_logging(settings.log_level, role="shard", index=settings.index, pid=os.getpid())
    slot = sockets = None
    try:
        pin_process(wiring.spec.device, wiring.spec.threads, wiring.spec.cpus)
        sockets = Sockets(zmq.Context(), *open_fabric(settings.runtime_dir, settings.fabric))
        agent, slot = build_agent(settings, sockets, log)
        agent.ports.control.send(Ready("shard", settings.index, os.getpid()))
        log.info("shard ready", stage=wiring.stage, experts=list(wiring.experts), layers=sorted(agent.bank))
        agent.serve()
        log.info("shard stopped")
    except Exception:
        log.exception("shard failed")
        raise SystemExit(1) from None
    finally:
        if slot is not None:
            slot.close()
        if sockets is not None:
            sockets.end()
