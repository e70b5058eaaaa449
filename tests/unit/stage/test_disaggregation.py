"""Disaggregated plans without processes: the plan format, the hand-off price, the
pieces that let a request move between pools (sampling, scheduling, token order)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from kvasir.bridge.ledger import HandoffLog, Pending
from kvasir.cli.main import kvasir
from kvasir.config.plan import parse_plan, plan_toml
from kvasir.daemon.footprint import break_even_gibps, handoff_ms
from kvasir.errors import PlanError
from kvasir.sched.scheduler import Scheduler
from kvasir.stage.sampling import RequestSampler
from kvasir.units import MIB
from kvasir.wire.batch import NewRequest, SampledToken, SamplingParams
from kvasir.wire.head import BatchResult
from tests.support.models import make_plan

POOLS = """
[[prefill.stages]]
layers = [0, 2]
[[prefill.stages]]
layers = [2, 5]
[[prefill.stages]]
layers = [5, 6]
[[decode.stages]]
layers = [0, 4]
[[decode.stages]]
layers = [4, 6]
"""


def disagg_text(source: str, extra: str = "") -> str:
    return f'[model]\nsource = "{source}"\nmax_seq_len = 256\n[kv]\nblock_size = 16\nnum_blocks = 32\n{extra}{POOLS}'


def test_pools_are_rings_of_their_own_with_their_own_widths():
    plan = parse_plan(
        disagg_text(
            "x", "[prefill.batch]\nmax_rows = 2\nmax_tokens = 64\n[decode.kv]\nblock_size = 8\nnum_blocks = 64\n"
        )
    )
    p_ring, d_ring = plan.rings()
    prefill, decode = p_ring.plan, d_ring.plan
    assert (p_ring.pool, d_ring.pool) == ("prefill", "decode") and plan.disaggregated
    assert (p_ring.first, d_ring.first) == (0, 3)
    assert [s.layers for s in prefill.stages] == [(0, 2), (2, 5), (5, 6)]
    assert [s.layers for s in decode.stages] == [(0, 4), (4, 6)]
    assert prefill.batch.max_tokens == 64 and decode.batch == plan.batch
    assert decode.kv.block_size == 8 and prefill.kv == plan.kv
    assert len(plan.all_stages) == 5 and plan.num_layers == 6
    assert parse_plan(plan_toml(plan)) == plan


@pytest.mark.parametrize(
    "text, fragment",
    [
        (POOLS + "[[stages]]\nlayers = [0, 6]\n", "instead of [[stages]]"),
        (POOLS.split("[[decode")[0], "needs a [decode] pool"),
        (
            POOLS.replace("[[decode.stages]]\nlayers = [0, 4]\n", ""),
            "decode.stages: a pipeline needs at least two stages",
        ),
        (POOLS.replace("layers = [2, 5]", "layers = [3, 5]"), "prefill.stages[1].layers: gap"),
        ("[prefill.batch]\nmax_rows = 0\n" + POOLS, "prefill.batch.max_rows must be a positive integer"),
        ("[handoff]\nlease_s = 0\n" + POOLS, "handoff.lease_s must be a positive number"),
        (POOLS.replace("layers = [4, 6]", 'layers = [4, 6]\ndevice = "cuda:0"'), "decode.stages[1].device = 'cuda:0'"),
    ],
)
def test_bad_disaggregated_plans_are_refused_naming_the_key(text, fragment):
    with pytest.raises(PlanError, match=None) as info:
        parse_plan('[model]\nsource = "x"\n' + text)
    assert fragment in str(info.value)


def test_worked_balance():
    """docs/architecture.md, The price of a hand-off: 64 MiB at 1 GiB/s takes 62.5 ms, at 8 GiB/s 7.8125 ms; against 20 ms
    of interference the break-even is 3.125 GiB/s."""
    assert handoff_ms(64 * MIB, 1.0) == 62.5
    assert handoff_ms(64 * MIB, 8.0) == 7.8125
    assert break_even_gibps(64 * MIB, 20.0) == 3.125


def test_plan_check_prices_the_handoff(tmp_path, tiny_models):
    path = tmp_path / "plan.toml"
    path.write_text(disagg_text(str(tiny_models["llama"])))
    runner = CliRunner()
    result = runner.invoke(kvasir, ["plan", "check", str(path), "--handoff-mib", "64", "--prompt-tokens", "100"])
    assert result.exit_code == 0, result.output
    assert "62.5 ms" in result.output and "3.125 GiB/s" in result.output
    roles = [line.split()[1:3] for line in result.output.splitlines() if line[:1].isdigit()]
    assert roles == [
        ["prefill", "head"],
        ["prefill", "middle"],
        ["prefill", "tail"],
        ["decode", "head"],
        ["decode", "tail"],
    ]
    body = json.loads(runner.invoke(kvasir, ["plan", "check", "--json", str(path), "--link-gibps", "8"]).output)
    # K and V x 6 layers x 2 kv heads x head dim 16 x 4 bytes
    per_token = 2 * 6 * 2 * 16 * 4
    assert body["handoff"]["kv_bytes_per_token"] == per_token
    first = body["handoff"]["sizes"][0]
    assert first["kv_bytes"] == 128 * per_token and first["handoff_ms"] == handoff_ms(128 * per_token, 8.0)
    assert [s["pool"] for s in body["stages"]] == ["prefill"] * 3 + ["decode"] * 2


def test_a_seeded_request_continues_in_another_process_with_the_same_draws():
    """The decode pool's tail picks tokens 1.. of a request whose token 0 the prefill
    pool's tail picked: with the same seed it must draw what one sampler would have."""
    params = SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=6)
    logits = [torch.randn(50, generator=torch.Generator().manual_seed(k)) for k in range(6)]
    one = RequestSampler(NewRequest(1, params, 11), (), 1000)
    whole = [one.pick(row) for row in logits]
    first = RequestSampler(NewRequest(1, params, 11), (), 1000).pick(logits[0])
    rest = RequestSampler(NewRequest(1, params, 11, generated=1), (), 1000)
    assert [first] + [rest.pick(row) for row in logits[1:]] == whole
    assert len(set(whole)) > 1  # it really samples


def test_prefill_reserves_the_prompt_and_decode_takes_a_parked_request_in():
    plan = make_plan("unused", [(0, 1), (1, 2)], block_size=4, num_blocks=20, max_tokens=32, max_seq_len=80)
    prefill = Scheduler(plan, 100, reserve_output=False)
    rid = prefill.submit(list(range(3, 13)), SamplingParams(max_tokens=40))
    batch = prefill.next_batch()
    assert prefill.cache.available == 20 - 3  # ten prompt tokens: three blocks, no room for the output
    [event] = prefill.complete(BatchResult(batch.descriptor.batch_id, (SampledToken(rid, 7, 0, None),)))
    state = prefill.park(rid)
    assert prefill.next_batch() is None  # parked: no decode row in the prefill pool
    decode = Scheduler(plan, 100)
    blocks = decode.reserve(rid, len(state.prompt), state.output, state.sampling, state.seed)
    assert len(blocks) == 13  # 10 + 40 tokens
    assert decode.next_batch() is None  # parked until every decode stage holds the KV
    decode.unpark(rid)
    row = decode.next_batch().descriptor.rows[0]
    assert (row.start, row.num_tokens, row.new_blocks, row.emit) == (10, 1, (), True)
    assert decode.reserve(99, 10, state.output, state.sampling, state.seed) is None  # full: it waits
    prefill.retire(rid)
    assert prefill.cache.available == 20 and prefill.release_only().release == (rid,)


def test_tokens_overtaking_each_other_are_streamed_in_order():
    record = Pending(peer=None, key=1, prompt_tokens=3, submitted_ns=0, detokenizer=None)
    second = SampledToken(5, 42, 1, None)
    assert record.in_order(second) == []  # the decode pool's token came before the prefill pool's
    first = SampledToken(5, 41, 0, None)
    assert record.in_order(first) == [first, second]


def test_handoff_log_summary():
    log = HandoffLog()
    assert log.summary() is None
    timings = log.add(1 << 30, 0.5, 0.25)
    assert timings.gibps == 4.0
    for k in range(99):
        log.add(1 << 20, 0.001 * (k + 1), 0.001)
    summary = log.summary()
    assert summary.count == 100 and summary.kv_bytes == (1 << 30) + 99 * (1 << 20)
    assert summary.p50_s == pytest.approx(0.051) and summary.p99_s == 0.5  # sorted: 0.001 .. 0.099, 0.5


def test_a_decode_stage_copies_its_layers_out_of_differently_split_prefill_stages(tmp_path):
    """Prefill stages hold layers [0, 2) and [2, 5) in blocks of 8 tokens; a decode stage
    holding [1, 4) in blocks of 4 gets each position's K/V of its layers, from both."""
    import os
    import secrets

    import zmq

    from kvasir.model.kv_cache import PagedKVCache
    from kvasir.stage.handoff import KvReceiver
    from kvasir.stage.kv_segment import KvSegmentMap
    from kvasir.transport.channels import PullChannel, PushChannel
    from kvasir.wire.control import HandoffWiring, KvSegment
    from kvasir.wire.head import HeadMessage
    from kvasir.wire.kv import KvMessage, KvReady, Placement

    tag = f"kvasir-test-{os.getpid()}-{secrets.token_hex(3)}"
    segments = [
        KvSegment(name=f"{tag}-{k}", layers=layers, num_blocks=6, block_size=8, kv_heads=2, head_dim=4, dtype="float32")
        for k, layers in enumerate([(0, 2), (2, 5)])
    ]
    maps = [KvSegmentMap(segment, create=True) for segment in segments]
    ctx = zmq.Context()
    try:
        for k, m in enumerate(maps):
            m.keys.copy_(torch.randn(m.keys.shape, generator=torch.Generator().manual_seed(k)))
            m.values.copy_(torch.randn(m.values.shape, generator=torch.Generator().manual_seed(10 + k)))
        cache = PagedKVCache(3, 10, 4, 2, 4, dtype=torch.float32, device=torch.device("cpu"))
        inbox = PullChannel(ctx.socket(zmq.PULL), KvMessage)
        inbox.socket.bind("inproc://kv")
        head = PullChannel(ctx.socket(zmq.PULL), HeadMessage)
        head.socket.bind("inproc://head")
        out = ctx.socket(zmq.PUSH)
        out.connect("inproc://head")
        wiring = HandoffWiring(
            segments=dict(enumerate(segments)),
            layers=[s.layers for s in segments] + [(1, 4)],
            lease_s=60.0,
            prefill_heads=[0],
            decode_heads=[len(segments)],
        )
        receiver = KvReceiver(7, (1, 4), cache, wiring, inbox, PushChannel(out))
        send = ctx.socket(zmq.PUSH)
        send.connect("inproc://kv")
        to_stage = PushChannel(send)
        prefill_blocks, decode_blocks = (3, 1), (7, 2, 5)
        to_stage.send(Placement(11, decode_blocks))
        to_stage.send(KvReady(11, 0, (0, 2), prefill_blocks, 10, 0))
        receiver.receive()
        assert head.drain() == []  # one part is not the whole
        to_stage.send(KvReady(11, 1, (2, 5), prefill_blocks, 10, 0))
        receiver.receive()
        [held] = head.drain()
        assert (held.request_id, held.stage, held.nbytes) == (11, 7, 2 * 3 * 10 * 2 * 4 * 4)
        for layer in (1, 2, 3):
            source = maps[0] if layer < 2 else maps[1]
            first = source.spec.layers[0]
            for pos in range(10):
                src = prefill_blocks[pos // 8] * 8 + pos % 8
                dst = decode_blocks[pos // 4] * 4 + pos % 4
                assert torch.equal(cache.keys[layer - 1, dst], source.keys[layer - first, src])
                assert torch.equal(cache.values[layer - 1, dst], source.values[layer - first, src])
        assert cache.table(11) == list(decode_blocks)
        to_stage.send(Placement(11, ()))  # dropped: its table goes
        to_stage.send(Placement(12, ()))  # a drop that overtook the announcements
        to_stage.send(KvReady(12, 0, (0, 2), prefill_blocks, 10, 0))
        receiver.receive()
        assert cache.requests == 0 and receiver.parts == {}
        receiver.close()
    finally:
        ctx.destroy(linger=0)
        for m in maps:
            m.close()
            m.unlink()
