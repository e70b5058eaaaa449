"""Fetching a prefix from another host's pool or computing it (kvasir/bridge/pool_choice.py):
the predicted times from the measured rates, and the fetch tried until measured."""

from __future__ import annotations

from kvasir.bridge.pool_choice import Fetch, Rates, worth_fetching
from kvasir.units import GIB, MIB

BLOCK = 16 * MIB  # one block's K/V over every layer
STAGES = [0, 1]


def test_a_fast_link_fetches_and_a_slow_one_computes():
    fetches = [Fetch(0, 10, 0.5), Fetch(1, 10, 0.5)]  # both stages fetch 10 blocks of half the layers: 80 MiB each
    ran = {0: (1000, 1.0), 1: (2000, 1.0)}  # the slower stage: 1,000 tokens a busy second
    fast = Rates({0: (GIB, 1.0), 1: (GIB, 1.0)}, ran)  # 80 MiB at 1 GiB/s, one stage after the other
    fetch, why = worth_fetching(fetches, 160, BLOCK, "a", STAGES, fast)
    assert fetch and why == (
        "160 tokens fetched: fetching from another host's pool predicted 0.156 s, "
        "computing 0.160 s at 1000 tokens/s, its slowest stage's"
    )
    slow = Rates({0: (GIB, 1.0), 1: (GIB // 2, 1.0)}, ran)  # stage 1's link: 0.5 GiB/s, so 0.078 + 0.156 s
    fetch, why = worth_fetching(fetches, 160, BLOCK, "a", STAGES, slow)
    assert not fetch and "computed" in why and "predicted 0.234 s" in why


def test_the_instances_measured_prompts_set_the_compute_time():
    fetches = [Fetch(1, 10, 1.0)]  # 160 MiB at 1 GiB/s: 0.156 s
    rates = Rates({1: (GIB, 1.0)}, {0: (1000, 1.0), 1: (1000, 1.0)})  # the stages alone: 0.160 s for 160 tokens
    rates.prefilled("a", 100, 1.0)  # too short a prompt to count
    rates.prefilled("a", 500, 1.0)  # a lone prompt runs slower than the stages' rate: 2 ms a token
    fetch, why = worth_fetching(fetches, 160, BLOCK, "a", STAGES, rates)
    assert fetch and why.endswith("computing 0.320 s at 500 tokens/s measured on its prompts")
    rates.prefilled("a", 1000, 0.5)  # 0.5 ms a token: the average moves three tenths of the way
    assert abs(rates.per_token_s["a"] - (0.3 * 0.0005 + 0.7 * 0.002)) < 1e-12
    assert worth_fetching(fetches, 160, BLOCK, "b", STAGES, rates)[1].endswith("its slowest stage's")


def test_unmeasured_rates_try_the_fetch():
    fetches = [Fetch(1, 4, 1.0)]
    fetch, why = worth_fetching(fetches, 64, BLOCK, "a", STAGES, Rates({}, {0: (10, 1.0), 1: (10, 1.0)}))
    assert fetch and "no fetch measured yet" in why
    fetch, why = worth_fetching(fetches, 64, BLOCK, "a", STAGES, Rates({1: (GIB, 0.01)}, {}))  # 10 ms: not yet a rate
    assert fetch and "no fetch measured yet" in why
    fetch, why = worth_fetching(fetches, 64, BLOCK, "a", STAGES, Rates({1: (GIB, 1.0)}, {0: (10, 1.0)}))
    assert fetch and "no compute measured yet" in why  # stage 1 never ran a batch
