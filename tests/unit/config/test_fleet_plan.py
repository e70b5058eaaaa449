"""Instances in the plan: the format, its checks, the rings and hand-off routes it makes,
and what `kvasir plan check` prints of them."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvasir.cli.main import kvasir
from kvasir.config.fleet import MAX_INSTANCES, handoff_routes
from kvasir.config.plan import check_model_fit, parse_plan, plan_toml
from kvasir.errors import PlanError
from tests.support.plans import refused

HEAD = '[model]\nsource = "x"\nmax_seq_len = 256\n[kv]\nblock_size = 16\nnum_blocks = 32\n'


def instance(name: str, splits, table: str = "instances", extra: str = "") -> str:
    stages = "".join(f"[[{table}.stages]]\nlayers = [{a}, {b}]\n" for a, b in splits)
    return f'[[{table}]]\nname = "{name}"\n{extra}{stages}'


TWO = (
    HEAD
    + instance("a", [(0, 3), (3, 6)])
    + instance("b", [(0, 2), (2, 4), (4, 6)], extra="[instances.batch]\nmax_rows = 4\nmax_tokens = 16\n")
)
XPYD = (
    HEAD
    + instance("p0", [(0, 3), (3, 6)], "prefill.instances")
    + instance("p1", [(0, 4), (4, 6)], "prefill.instances")
    + "[decode.batch]\nmax_rows = 8\nmax_tokens = 8\n"
    + instance("d0", [(0, 2), (2, 6)], "decode.instances")
    + instance("d1", [(0, 5), (5, 6)], "decode.instances")
)


def test_colocated_instances_are_rings_in_global_order():
    plan = parse_plan(TWO)
    rings = plan.rings()
    assert [(r.pool, r.name, r.first, r.last, r.key) for r in rings] == [
        ("", "a", 0, 1, "instances[0].stages"),
        ("", "b", 2, 4, "instances[1].stages"),
    ]
    assert rings[1].plan.batch.max_rows == 4 and rings[0].plan.batch == plan.batch
    assert rings[0].plan.instances == () and [s.layers for s in rings[1].plan.stages] == [(0, 2), (2, 4), (4, 6)]
    assert len(plan.all_stages) == 5 and plan.route.policy == "cache_aware"
    assert parse_plan(plan_toml(plan)) == plan
    check_model_fit(plan, 6, None)
    with pytest.raises(PlanError, match=r"instances\[0\]\.stages\[1\]\.layers ends at 6"):
        check_model_fit(plan, 7, None)


def test_a_single_ring_is_one_instance_named_after_its_pool():
    plan = parse_plan(HEAD + "[[stages]]\nlayers = [0, 3]\n[[stages]]\nlayers = [3, 6]\n")
    [ring] = plan.rings()
    assert (ring.pool, ring.name, ring.first, ring.key) == ("", "ring", 0, "stages")


def test_disaggregated_instances_and_their_routes():
    plan = parse_plan(XPYD + '[route]\npolicy = "least_loaded"\n')
    rings = plan.rings()
    assert [(r.pool, r.name, r.first) for r in rings] == [
        ("prefill", "p0", 0),
        ("prefill", "p1", 2),
        ("decode", "d0", 4),
        ("decode", "d1", 6),
    ]
    assert rings[2].plan.batch.max_tokens == 8 and rings[0].plan.batch == plan.batch
    assert plan.route.policy == "least_loaded"
    assert parse_plan(plan_toml(plan)) == plan
    routes = {
        (p.name, d.name): [(k.source, k.target, k.layers, k.via) for k in links] for p, d, links in handoff_routes(plan)
    }
    assert list(routes) == [("p0", "d0"), ("p0", "d1"), ("p1", "d0"), ("p1", "d1")]
    assert routes[("p1", "d0")] == [(2, 4, (0, 2), "shm"), (2, 5, (2, 4), "shm"), (3, 5, (4, 6), "shm")]
    assert routes[("p0", "d1")] == [(0, 6, (0, 3), "shm"), (1, 6, (3, 5), "shm"), (1, 7, (5, 6), "shm")]


@pytest.mark.parametrize(
    "text, fragment",
    [
        (TWO + "[[stages]]\nlayers = [0, 6]\n", "give [[stages]] (one instance) or [[instances]] (several), not both"),
        (
            HEAD + instance("a", [(0, 3), (3, 6)]) + instance("a", [(0, 6)]),
            "instances[1].name = 'a' is instances[0]'s name too",
        ),
        (HEAD + instance("a b", [(0, 3), (3, 6)]), "instances[0].name = 'a b': an instance name is"),
        (
            HEAD + instance("a", [(0, 3), (3, 6)]) + instance("b", [(0, 6)]),
            "instances[1].stages: a pipeline needs at least two stages",
        ),
        (HEAD + instance("a", [(0, 3), (4, 6)]), "instances[0].stages[1].layers: gap between stages 0 and 1"),
        (
            HEAD + instance("a", [(0, 3), (3, 6)], extra="[instances.kv]\nblock_size = 4\nnum_blocks = 2\n"),
            "instances[0].kv: 2 blocks x 4 tokens",
        ),
        (
            HEAD + instance("a", [(0, 3), (3, 6)], extra="[instances.batch]\nmax_rows = 8\nmax_tokens = 4\n"),
            "instances[0].batch.max_tokens (4) must be >= ",
        ),
        (HEAD + '[[instances]]\nname = "a"\nthreads = 2\n', "instances[0].threads: unknown key"),
        (HEAD + "[[instances]]\n[[instances.stages]]\nlayers = [0, 6]\n", "instances[0].name: required key is missing"),
        (XPYD + instance("x", [(0, 3), (3, 6)]), "instances: a disaggregated plan has its stages in its pools"),
        (
            XPYD.replace("[[decode.instances]]", "[[decode.stages]]\nlayers = [0, 6]\n[[decode.instances]]", 1),
            "decode.instances: give [[decode.stages]]",
        ),
        (
            XPYD.replace('name = "d1"', 'name = "p0"'),
            "decode.instances[1].name = 'p0' is prefill.instances[0]'s name too",
        ),
        (
            HEAD + '[route]\npolicy = "random"\n' + instance("a", [(0, 3), (3, 6)]),
            "route.policy: invalid enum value 'random'",
        ),
    ],
)
def test_instance_refusals_name_the_key(text, fragment):
    assert fragment in refused(text)


def test_instances_are_bounded():
    text = HEAD + "".join(instance(f"i{k}", [(0, 3), (3, 6)]) for k in range(MAX_INSTANCES + 1))
    assert f"at most {MAX_INSTANCES}" in refused(text)


def test_plan_check_prints_instances_and_kv_routes(tmp_path, tiny_models):
    path = tmp_path / "fleet.toml"
    path.write_text(XPYD.replace('source = "x"', f'source = "{tiny_models["llama"]}"'))
    result = CliRunner().invoke(kvasir, ["plan", "check", str(path)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "route    cache_aware over 4 instances" in lines
    assert "instance p1: prefill stages 2, 3" in lines and "instance d1: decode stages 6, 7" in lines
    assert "kv route p1 -> d0: 2->4 [0, 2) shm, 2->5 [2, 4) shm, 3->5 [4, 6) shm" in lines
    stage_rows = [line.split() for line in lines if line.split()[:1] == ["3"]]
    assert stage_rows and stage_rows[0][-1] == "p1"  # the stage table names each stage's instance
    body = json.loads(CliRunner().invoke(kvasir, ["plan", "check", "--json", str(path)]).output)
    assert body["instances"][3] == {"name": "d1", "pool": "decode", "stages": [6, 7], "hosts": [None, None]}
    assert [(r["prefill"], r["decode"]) for r in body["routes"]] == [
        ("p0", "d0"),
        ("p0", "d1"),
        ("p1", "d0"),
        ("p1", "d1"),
    ]
    assert [s["instance"] for s in body["stages"]] == ["p0", "p0", "p1", "p1", "d0", "d0", "d1", "d1"]


def test_plan_check_says_who_may_move_and_who_moves_them(tmp_path, tiny_models):
    source = XPYD.replace('source = "x"', f'source = "{tiny_models["llama"]}"')
    for section, says in [
        ("[planner]\n", "planner  movable: p0, p1, d0, d1; moved by hand (`kvasir instances move`); at least 1"),
        (
            "[planner]\nenabled = true\nttft_s = 3\nmin_decode = 2\n",
            "planner  movable: p0, p1, d0, d1; the planner moves them against TTFT 3 s and ITL 0.2 s at p90, "
            "every 10 s (patience 2, headroom 0.8, cooldown 30 s); at least 1 prefill and 2 decode",
        ),
    ]:
        path = tmp_path / "fleet.toml"
        path.write_text(section + source)
        result = CliRunner().invoke(kvasir, ["plan", "check", str(path)])
        assert result.exit_code == 0, result.output
        assert any(line.startswith(says) for line in result.output.splitlines()), result.output
