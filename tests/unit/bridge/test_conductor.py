"""The conductor's policies on their own: which instance each request goes to, and why."""

from __future__ import annotations

import pytest

from kvasir.bridge.conductor import PREDICTED_S, Candidate, Conductor
from kvasir.errors import RequestError
from kvasir.sched.prefix import block_keys

BLOCK = 4


def conductor(policy: str, names=("a", "b", "c"), capacity: int = 64) -> Conductor:
    return Conductor(policy, [Candidate(name, BLOCK, capacity) for name in names])  # type: ignore[arg-type]


def test_round_robin_takes_the_serving_instances_in_turn():
    c = conductor("round_robin")
    assert [c.pick([1, 2, 3], b"", 0.0).name for _ in range(4)] == ["a", "b", "c", "a"]
    c.down("b")
    assert {c.pick([1], b"", 0.0).name for _ in range(4)} == {"a", "c"}
    for name in "abc":
        c.down(name)
    with pytest.raises(RequestError) as info:
        c.pick([1], b"", 0.0)
    assert info.value.code == "restarting"
    c.up("b")
    assert c.pick([1], b"", 0.0).name == "b"


def test_least_loaded_follows_the_requests_on_each_instance():
    c = conductor("least_loaded")
    first = [c.pick([1, 2], b"", 0.0) for _ in range(3)]
    assert sorted(choice.name for choice in first) == ["a", "b", "c"]
    c.ended("b", 0)
    choice = c.pick([1, 2], b"", 0.0)
    assert choice.name == "b" and choice.reason == "least_loaded: 0 requests on it"


def test_cache_aware_sends_a_shared_prefix_where_it_is_cached():
    c = conductor("cache_aware")
    prompt = list(range(40))
    keys = block_keys(prompt, BLOCK, 10)
    c.events("b", keys[:8], [], False)  # b's head registered the first 32 tokens' blocks
    choice = c.pick(prompt + [7], b"", 0.0)
    assert (choice.name, choice.cached_tokens, choice.backlog) == ("b", 32, 9)
    assert choice.reason.startswith("cache_aware: 32 of 41 prompt tokens cached")
    assert c.pick(prompt, b"other-namespace", 0.0).name != "b"  # another namespace's keys differ
    c.events("b", [], keys[:8], False)  # evicted
    assert c.candidates["b"].cached_tokens(keys, 0.0) == 0


def test_cache_aware_keeps_a_burst_together_and_spreads_distinct_prompts():
    c = conductor("cache_aware")
    shared = list(range(100, 140))
    burst = [c.pick(shared + [k], b"", 0.0).name for k in range(5)]
    assert len(set(burst)) == 1  # predicted at once: the burst waits for one prefill, not three
    distinct = {c.pick(list(range(1000 * k, 1000 * k + 40)), b"", 0.0).name for k in range(1, 3)}
    assert burst[0] not in distinct  # its instance has the burst's backlog: new prompts go elsewhere
    later = PREDICTED_S + 1.0  # unconfirmed predictions expire
    assert c.candidates[burst[0]].cached_tokens(block_keys(shared, BLOCK, 10), later) == 0


def test_a_heavy_backlog_outweighs_a_small_cached_prefix():
    c = conductor("cache_aware", names=("a", "b"))
    prompt = list(range(400))
    c.events("a", block_keys(prompt, BLOCK, 2), [], False)  # 8 tokens cached on a
    c.candidates["a"].backlog = 1000
    assert c.pick(prompt, b"", 0.0).name == "b"


def test_first_tokens_and_ends_take_work_off_an_instance():
    c = conductor("cache_aware", names=("a",))
    choice = c.pick(list(range(20)), b"", 0.0)
    a = c.candidates["a"]
    assert (a.running, a.backlog, a.routed) == (1, 20, 1)
    c.first_token("a", choice.backlog)
    assert (a.running, a.backlog) == (1, 0)
    c.ended("a", 0)
    assert a.running == 0
    c.down("a")
    assert a.keys == {} and a.state == "down"


def test_the_index_is_bounded_by_what_an_instance_can_hold():
    c = conductor("cache_aware", names=("a",), capacity=4)
    for k in range(10):
        c.pick(list(range(1000 * k, 1000 * k + 16)), b"", float(k))
        assert len(c.candidates["a"].keys) <= 8


def test_a_session_stays_on_its_instance_while_it_serves(monkeypatch):
    c = conductor("round_robin")
    first = c.pick([1, 2], b"", 0.0, session=b"s1")
    assert [c.pick([3], b"", 0.0, session=b"s1").name for _ in range(3)] == [first.name] * 3
    again = c.pick([3], b"", 0.0, session=b"s1")
    assert again.reason == "affinity: the instance of the session's earlier requests"
    c.down(first.name)
    moved = c.pick([4], b"", 0.0, session=b"s1")  # its instance failed: the policy picks anew, and it sticks
    assert moved.name != first.name and c.pick([5], b"", 0.0, session=b"s1").name == moved.name
    monkeypatch.setattr("kvasir.bridge.conductor.SESSIONS_KEPT", 2)
    for k in range(5):
        c.pick([6], b"", 0.0, session=f"s{k + 2}".encode())
    assert len(c.sessions) == 2 and list(c.sessions) == [b"s5", b"s6"]


def test_a_leaving_instance_gets_nothing_new_and_moves_to_the_other_side():
    """kvasir/bridge/moves.py: an instance moving to the decode pool takes no new request,
    its running ones still end there; once assigned it is a decode instance, down until
    up, with nothing on it; its cached keys stay (its stages keep their cache), and its
    head's prefix events go on counting there."""
    c = Conductor(  # type: ignore[arg-type]
        "least_loaded", [Candidate("a", BLOCK, 64), Candidate("b", BLOCK, 64)], [Candidate("d", BLOCK, 64)]
    )
    first = c.pick([1, 2, 3, 4, 5], b"", 0.0)
    c.leave(first.name)
    other = "b" if first.name == "a" else "a"
    assert {c.pick([6, 7], b"", 0.0).name for _ in range(3)} == {other}
    c.ended(first.name, 5)
    assert c.candidates[first.name].running == 0
    c.events(first.name, [b"k1", b"k2"], [], False)
    c.assign(first.name, decode=True)
    assert first.name not in c.candidates and c.decoders[first.name].state == "down"
    c.events(first.name, [b"k3"], [b"k1"], False)
    assert set(c.decoders[first.name].keys) >= {b"k2", b"k3"} and b"k1" not in c.decoders[first.name].keys
    assert c.pick_decode() == "d"
    c.up(first.name)
    assert c.pick_decode() == first.name  # the fewest requests on it
    c.leave(other)
    with pytest.raises(RequestError, match="no instance is serving"):
        c.pick([1], b"", 0.0)
