"""Values that pass validation reach the stages, generated: every one is served or
refused, never crashes a worker, and normal requests sent alongside stay exact.

The client protocol fuzz (tests/integration/test_fuzz.py) stops at the bridge; here the
submissions are well-formed, so they travel to the head, every stage and the tail's
sampler: temperatures down to the smallest subnormal and up to the largest float,
top-p at its edges, top-k past the vocabulary, seeds at their limits, full stop lists,
max_tokens up to 2**64 - 1, prompts up to max_seq_len - 1 tokens, penalties, min_p and
logit biases over their whole ranges.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvasir.client import AsyncClient
from kvasir.wire.base import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from kvasir.wire.client import ErrorEvent, Finished
from tests.support.daemon import BIN
from tests.support.models import hf_greedy, random_prompts, reference_model

VOCAB = 320
MAX_SEQ_LEN = 48

legal = st.fixed_dictionaries(
    {
        "token_ids": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_SEQ_LEN - 1),
        "temperature": st.one_of(st.floats(0, sys.float_info.max), st.sampled_from([0.0, 5e-324, 1e-45, 1e-38, 1e308])),
        "top_p": st.one_of(st.floats(5e-324, 1.0), st.sampled_from([5e-324, 1e-300, 1.0])),
        "top_k": st.one_of(st.integers(0, 2**63 - 1), st.integers(0, VOCAB + 2)),
        "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1), st.sampled_from([0, 2**63 - 1])),
        "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=MAX_STOP_TOKEN_IDS),
        "max_tokens": st.one_of(st.integers(1, 2**64 - 1), st.integers(1, MAX_SEQ_LEN)),
        "ignore_eos": st.booleans(),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.one_of(st.floats(0, 10, exclude_min=True), st.sampled_from([5e-324, 1.0, 10.0])),
        "min_p": st.floats(0, 1),
        "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=MAX_LOGIT_BIAS),
        "min_tokens": st.integers(0, 1),
    }
)

illegal = st.one_of(
    st.fixed_dictionaries(
        {"temperature": st.one_of(st.floats(max_value=-1e-300), st.just(math.nan), st.just(math.inf))}
    ),
    st.fixed_dictionaries(
        {"top_p": st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0000001), st.just(math.nan))}
    ),
    st.fixed_dictionaries({"top_k": st.integers(-(2**63), -1)}),
    st.fixed_dictionaries({"seed": st.one_of(st.integers(-(2**63), -1), st.integers(2**63, 2**64 - 1))}),
    st.fixed_dictionaries({"max_tokens": st.integers(-(2**63), 0)}),
    st.fixed_dictionaries({"stop_token_ids": st.lists(st.integers(VOCAB, 2**40), min_size=1, max_size=3)}),
    st.fixed_dictionaries(
        {
            "stop_token_ids": st.lists(
                st.integers(0, 5), min_size=MAX_STOP_TOKEN_IDS + 1, max_size=MAX_STOP_TOKEN_IDS + 40
            )
        }
    ),
    st.fixed_dictionaries({"token_ids": st.lists(st.integers(VOCAB, 2**62), min_size=1, max_size=4)}),
    st.fixed_dictionaries({"presence_penalty": st.one_of(st.floats(min_value=2.0000001), st.just(math.nan))}),
    st.fixed_dictionaries({"repetition_penalty": st.one_of(st.floats(max_value=0.0), st.floats(min_value=10.000001))}),
    st.fixed_dictionaries({"min_p": st.one_of(st.floats(min_value=1.0000001), st.floats(max_value=-1e-300))}),
    st.fixed_dictionaries({"logit_bias": st.dictionaries(st.integers(VOCAB, 2**40), st.floats(-1, 1), min_size=1)}),
    st.fixed_dictionaries(
        {"logit_bias": st.dictionaries(st.integers(0, 5), st.floats(min_value=100.0001), min_size=1)}
    ),
    st.fixed_dictionaries({"min_tokens": st.integers(129, 2**40)}),  # over the default max_tokens, 128
    st.fixed_dictionaries(
        {"bad_words": st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=3)}
    ),  # no tokenizer
)


async def run_batch(runtime_dir, legal_batch, illegal_batch, normal):
    """Send everything at once from three clients; each request's terminal event."""
    async with (
        await AsyncClient.connect(runtime_dir) as fuzz,
        await AsyncClient.connect(runtime_dir) as refused,
        await AsyncClient.connect(runtime_dir) as plain,
    ):
        streams = [await fuzz.submit(**values) for values in legal_batch]
        bad = [await refused.submit(**{"token_ids": [5, 6], **values}) for values in illegal_batch]
        normals = [await plain.submit(token_ids=ids, max_tokens=8, temperature=0) for ids in normal]
        return (
            [await s.result() for s in streams],
            [await s.result() for s in bad],
            [await s.result() for s in normals],
        )


def test_legal_values_are_served_and_nothing_restarts(tiny_models, start_daemon):
    source = tiny_models["llama"]
    daemon = start_daemon(
        source, [(0, 2), (2, 4), (4, 6)], max_seq_len=MAX_SEQ_LEN, num_blocks=400, max_waiting=100_000
    ).wait_ready()
    model = reference_model(source)
    normal = random_prompts(VOCAB, [3, 9, 17], seed=5)
    expected = [hf_greedy(model, ids, 8) for ids in normal]
    seen = {"legal": 0, "illegal": 0}

    @settings(max_examples=8, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(legal, min_size=25, max_size=25), st.lists(illegal, min_size=6, max_size=6))
    def exchange(legal_batch, illegal_batch):
        served, refused, normals = asyncio.run(run_batch(daemon.runtime_dir, legal_batch, illegal_batch, normal))
        for values, event in zip(legal_batch, served):
            assert isinstance(event, Finished), (values, event)
            assert 1 <= len(event.token_ids) <= min(values["max_tokens"], MAX_SEQ_LEN - len(values["token_ids"]))
            assert all(0 <= t < VOCAB for t in event.token_ids)
        for values, event in zip(illegal_batch, refused):
            assert isinstance(event, ErrorEvent) and event.code == "invalid_request", (values, event)
        assert [event.token_ids for event in normals] == expected
        seen["legal"] += len(served)
        seen["illegal"] += len(refused)

    exchange()
    assert seen["legal"] >= 200 and seen["illegal"] >= 48
    # the command-line recipe that used to crash the tail, six times (past max_restarts before)
    for _ in range(6):
        run = subprocess.run(
            [
                str(BIN / "kvasir"),
                "generate",
                "--ids",
                "5,6,7",
                "--temperature",
                "1e-38",
                "--max-tokens",
                "4",
                "--json",
                "--runtime-dir",
                str(daemon.runtime_dir),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert json.loads(run.stdout.splitlines()[-1])["type"] == "finished"
    with daemon.client() as client:
        stats = client.stats()
    assert stats.restarts == 0 and stats.state == "serving" and stats.last_failure is None
    assert daemon.process.poll() is None
