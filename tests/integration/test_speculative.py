"""Speculative decoding in the daemon: greedy output with prompt-lookup drafts equals
Hugging Face's in every kind of plan (colocated, disaggregated, instances, expert
shards); each request's drafts are counted in its ``finished`` event, the daemon's in
``kvasir stats`` and Prometheus; a request may turn drafting off, and structured output
constrains draft positions as any other."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from typing import NamedTuple

import pytest
from test_http import metrics, own_front, value
from test_ring import check_events

from kvasir.client import AsyncClient
from kvasir.wire.client import Finished
from tests.support.daemon import kvasir_stats, serving_daemon, settled
from tests.support.models import hf_greedy, random_prompts, reference_model

SPEC = 'method = "ngram"\nnum_tokens = 4\nngram_min = 1'
DISAGG = {"prefill": [(0, 3), (3, 6)], "decode": [(0, 2), (2, 6)]}
PLANS = {  # the model, its split, expert shards, and a draft model (None: prompt lookup)
    "colocated": ("llama-loop", [(0, 3), (3, 6)], None, None),
    "disaggregated": ("llama-loop", DISAGG, None, None),
    "instances": ("llama-loop", {"a": [(0, 3), (3, 6)], "b": [(0, 4), (4, 6)]}, None, None),
    "expert-shards": ("mixtral", [(0, 3), (3, 6)], {0: [(0, 3), (3, 8)]}, None),
    "draft": ("llama-loop", [(0, 3), (3, 6)], None, "llama-loop"),
    "draft-disagg": ("llama", DISAGG, None, "llama-draft"),
}


async def greedy(runtime_dir, prompts, budget, **options):
    async with await AsyncClient.connect(runtime_dir) as client:
        streams = [await client.submit(token_ids=p, max_tokens=budget, temperature=0, **options) for p in prompts]
        return [check_events([event async for event in stream])[1] for stream in streams]


@pytest.fixture(scope="module")
def colocated(tiny_models, tmp_path_factory):
    """The colocated plan with prompt lookup, for the tests that count from what its stats
    already hold."""
    with serving_daemon(
        tmp_path_factory.mktemp("spec"),
        tiny_models["llama-loop"],
        [(0, 3), (3, 6)],
        speculative=SPEC,
        max_rows=6,
        num_blocks=200,
    ) as daemon:
        yield daemon


class Counts(NamedTuple):
    drafted: int
    accepted: int
    tokens: int
    rows: int


def counts(runtime_dir) -> Counts:
    """The daemon's draft counts once every stage has reported (zeros before any draft)."""
    totals = settled(runtime_dir).drafts
    return Counts(0, 0, 0, 0) if totals is None else Counts(totals.drafted, totals.accepted, totals.tokens, totals.rows)


@pytest.mark.parametrize("kind", PLANS)
def test_greedy_output_with_drafts_equals_hf_generate(tiny_models, start_daemon, request, kind):
    family, splits, experts, draft = PLANS[kind]
    extra = {"experts": experts} if experts else {}
    spec = SPEC if draft is None else f'method = "draft"\nnum_tokens = 3\ndraft_model = "{tiny_models[draft]}"'
    if kind == "colocated":
        daemon = request.getfixturevalue("colocated")
    else:
        daemon = start_daemon(
            tiny_models[family], splits, name=f"spec-{kind}", speculative=spec, max_rows=6, num_blocks=200, **extra
        ).wait_ready()
    before = counts(daemon.runtime_dir)
    prompts = [p + p[:3] for p in random_prompts(320, [3, 9, 20, 41, 6, 14], seed=8)]
    finals = asyncio.run(greedy(daemon.runtime_dir, prompts, 24))
    model = reference_model(tiny_models[family])
    for prompt, final in zip(prompts, finals):
        assert isinstance(final, Finished), final
        assert final.token_ids == hf_greedy(model, prompt, 24)[: len(final.token_ids)]
    drafted = [final.drafts for final in finals if final.drafts is not None]
    assert drafted and all(d.tokens_per_pass >= 1 and 0 <= d.acceptance <= 1 for d in drafted)
    after = counts(daemon.runtime_dir)  # every stage's report after the last request
    totals = Counts(*(a - b for a, b in zip(after, before)))
    assert totals.drafted == sum(d.drafted for d in drafted)
    assert totals.accepted == sum(d.accepted for d in drafted)
    if family == "llama-loop":  # its drafts are mostly confirmed: fewer passes than tokens
        assert totals.accepted > totals.drafted / 2 and totals.tokens > 1.5 * totals.rows
    if draft == family:  # a model drafting for itself is always right
        assert totals.accepted == totals.drafted


def test_a_request_can_turn_drafting_off_and_stats_show_the_counts(colocated):
    daemon = colocated
    before = counts(daemon.runtime_dir)
    prompt = random_prompts(320, [10], seed=9)
    on = asyncio.run(greedy(daemon.runtime_dir, prompt, 30))[0]
    off = asyncio.run(greedy(daemon.runtime_dir, prompt, 30, speculative=False))[0]
    assert on.token_ids == off.token_ids
    assert off.drafts is None and on.drafts is not None and on.drafts.accepted > 0
    assert on.drafts.passes < len(on.token_ids)
    assert counts(daemon.runtime_dir).accepted - before.accepted == on.drafts.accepted
    shown = kvasir_stats(daemon.runtime_dir).stdout
    assert re.search(r"speculative decoding: \d+ of \d+ drafts confirmed \(\d+%\), [\d.]+ tokens per pass", shown)
    body = json.loads(kvasir_stats(daemon.runtime_dir, "--json").stdout)
    assert body["drafts"]["accepted"] - before.accepted == on.drafts.accepted


def test_http_requests_draft_under_a_grammar_and_prometheus_counts_them(tiny_models, start_daemon):
    daemon, client = own_front(tiny_models, start_daemon, http={"model_name": "tiny-llama"}, speculative=SPEC)
    shaped = {"structured_outputs": {"regex": "(ab){6}[0-9]{3}"}}
    texts = {}
    for speculative in (True, False):
        done = client.completions.create(
            model="tiny-llama",
            prompt="ab ab ab ab",
            max_tokens=40,
            temperature=0.8,
            seed=3,
            extra_body={**shaped, "speculative": speculative},
        )
        texts[speculative] = done.choices[0].text
    assert re.fullmatch("(ab){6}[0-9]{3}", texts[True]) and texts[True] == texts[False]
    settled(daemon.runtime_dir)
    families = metrics(daemon)
    assert value(families["kvasir:spec_decode_num_draft_tokens"], "_total") > 0
    accepted = value(families["kvasir:spec_decode_num_accepted_tokens"], "_total")
    assert 0 <= accepted <= value(families["kvasir:spec_decode_num_draft_tokens"], "_total")
    assert value(families["kvasir:spec_decode_passes"], "_total") > 0
    assert "batch_full" in {s.labels.get("reason") for s in families["kvasir:spec_decode_rows_without_drafts"].samples}


def test_scripts_draft_model_keeps_a_models_first_layers(tiny_models, tmp_path):
    made = subprocess.run(
        ["scripts/draft-model", str(tiny_models["llama"]), "2", str(tmp_path / "draft")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    draft, full = reference_model(tmp_path / "draft"), reference_model(tiny_models["llama"])
    assert draft.config.num_hidden_layers == 2 and draft.config.vocab_size == full.config.vocab_size
    for name, tensor in draft.state_dict().items():
        assert (tensor == full.state_dict()[name]).all(), name  # the same weights, fewer layers
    refused = subprocess.run(
        ["scripts/draft-model", str(tiny_models["llama"]), "6", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "LAYERS must be in 1..5" in refused.stderr
