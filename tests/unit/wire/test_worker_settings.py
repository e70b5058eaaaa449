"""A child's settings: one struct per role, told apart by the ``role`` tag, each holding
only what its role uses; a follower takes only stages' and shards'."""

import msgspec
import pytest

from kvasir.config.experts import ShardSpec
from kvasir.config.kvpool import KvPoolSpec
from kvasir.daemon.children import ChildId
from kvasir.daemon.follower import Local, localize
from kvasir.errors import KvasirError
from kvasir.wire.control import (
    BridgeSettings,
    DispatchSlot,
    FabricSettings,
    FrontSettings,
    ModelFacts,
    PoolTiers,
    ShardSettings,
    ShardWiring,
    StageSettings,
    WorkerSettings,
)
from tests.support.models import make_plan

PLAN = make_plan("unused", [(0, 1), (1, 2)])
COMMON = dict(plan=PLAN, runtime_dir="/nonexistent", launcher_pid=1)
SLOT = DispatchSlot(name="kvasir-1-0-dispatch", max_rows=8, hidden=16, top_k=2, dtype="float32")
WIRING = ShardWiring(number=0, stage=1, layers=(1, 2), spec=ShardSpec(experts=(0, 4)), slot=SLOT)


def every_role() -> list:
    return [
        StageSettings(index=1, edges=[], pool="decode", first=1, **COMMON),
        ShardSettings(index=0, wiring=WIRING, pool="decode", **COMMON),
        BridgeSettings(model=ModelFacts(100, None), **COMMON),
        FrontSettings(index=2, model=ModelFacts(100, "/m"), listen_fd=7, **COMMON),
    ]


def test_each_role_round_trips_as_itself_and_names_its_child():
    decoder = msgspec.msgpack.Decoder(WorkerSettings)
    for settings in every_role():
        again = decoder.decode(msgspec.msgpack.encode(settings))
        assert type(again) is type(settings) and again == settings
    assert [ChildId.of(s).name for s in every_role()] == ["stage-1", "shard-0", "bridge", "front-2"]
    assert [ChildId.of(s).pool for s in every_role()] == ["decode", "decode", "", ""]


def test_one_roles_settings_are_not_taken_for_anothers():
    body = msgspec.msgpack.encode(every_role()[2])  # a bridge's
    with pytest.raises(msgspec.ValidationError, match="role"):
        msgspec.msgpack.decode(body, type=StageSettings)
    front = msgspec.to_builtins(every_role()[3])
    del front["listen_fd"]  # a front without its socket is refused, not started
    with pytest.raises(msgspec.ValidationError, match="listen_fd"):
        msgspec.convert(front, WorkerSettings)


def test_a_follower_takes_stages_and_shards_only():
    fabric = FabricSettings(host="b", keys="/k", secret="/leader-secret", sockets={})
    here = Local(host="b", runtime_dir="/run/b", secret="/b-secret", source="/models/m", model="m")
    names = {SLOT.name: "kvasir-2-0-dispatch"}
    shard = localize(msgspec.structs.replace(every_role()[1], fabric=fabric), here, names, PLAN)
    assert isinstance(shard, ShardSettings) and shard.wiring.slot.name == "kvasir-2-0-dispatch"
    assert shard.fabric is not None and shard.fabric.secret == "/b-secret" and shard.plan.model.source == "/models/m"
    for other in every_role()[2:]:
        with pytest.raises(KvasirError, match="not a worker of host b"):
            localize(msgspec.structs.replace(other, fabric=fabric), here, names, PLAN)


def test_a_follower_puts_its_stages_kv_pool_tiers_in_its_own_folders():
    """The leader's word on where a follower's stage keeps its KV pool slices is not
    taken: the follower's own plan and shared-memory prefix say."""
    plan = msgspec.structs.replace(PLAN, kv_pool=KvPoolSpec(host_bytes=1000, disk_dir="/var/kv", disk_bytes=3000))
    fabric = FabricSettings(host="b", keys="/k", secret="/leader-secret", sockets={})
    here = Local(host="b", runtime_dir="/run/b", secret="/b-secret", source="/models/m", model="m")
    leaders = PoolTiers(host_dir="/etc", host_bytes=1 << 40, disk_dir="/", disk_bytes=1 << 40)
    view = msgspec.structs.replace(plan, stages=plan.stages[1:])  # a stage's settings carry its ring's view only
    stage = StageSettings(index=1, edges=[], kv_pool=leaders, fabric=fabric, **{**COMMON, "plan": view})
    mine = localize(stage, here, {}, plan)
    assert isinstance(mine, StageSettings) and mine.kv_pool is not None
    assert mine.kv_pool.host_dir == f"/dev/shm/{here.prefix}-kvpool" and mine.kv_pool.disk_dir == "/var/kv"
    assert (mine.kv_pool.host_bytes, mine.kv_pool.disk_bytes) == (500, 1500)  # half the layers, half the bytes
