"""The bridge's reading of a submission's prefix-cache namespace: whose tenant it is, what
a salt adds, who may name a tenant, and what ``[kv] prefix_share = "all"`` leaves out."""

from __future__ import annotations

import pytest

from kvasir.bridge.submissions import LOCAL, Submissions
from kvasir.errors import RequestError
from kvasir.sched.prefix import namespace_root
from kvasir.wire.client import Submit

VOCAB = 100


def root(submissions: Submissions, origin: str = LOCAL, **fields) -> bytes:
    return submissions.read(Submit(key=1, token_ids=[1, 2, 3], **fields), origin)[2]


def test_each_tenant_has_its_own_root_and_a_salt_narrows_it():
    tenants = Submissions(None, VOCAB, 64, None, "tenant")
    roots = {
        root(tenants),
        root(tenants, "curve:A"),
        root(tenants, "curve:B"),
        root(tenants, "tcp"),
        root(tenants, tenant="key:1"),
        root(tenants, tenant="key:2"),
        root(tenants, tenant="key:1", cache_salt="s"),
        root(tenants, cache_salt="s"),
    }
    assert len(roots) == 8 and b"" not in roots
    assert root(tenants, tenant="key:1") == root(tenants, tenant="key:1")
    assert root(tenants, tenant="curve:A") != root(tenants, "curve:A")  # a local tenant cannot pose as a key


def test_only_local_clients_may_name_a_tenant():
    tenants = Submissions(None, VOCAB, 64, None, "tenant")
    for origin in ("curve:A", "tcp"):
        with pytest.raises(RequestError, match="tenant is for local clients"):
            root(tenants, origin, tenant="key:1")


def test_shared_by_all_only_salts_separate_requests():
    shared = Submissions(None, VOCAB, 64, None, "all")
    assert root(shared) == root(shared, "curve:A") == root(shared, tenant="key:1") == b""
    assert root(shared, cache_salt="s") == root(shared, "curve:B", cache_salt="s") == namespace_root("", "s")
    assert root(shared, cache_salt="s") != b""


def test_the_shaping_reaches_the_sampling_and_bad_words_are_tokenized_both_ways(tmp_path):
    from transformers import AutoTokenizer

    from tests.support.models import save_tiny_tokenizer

    save_tiny_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    read = Submissions(tokenizer, len(tokenizer), 64, None)
    msg = Submit(
        key=1,
        token_ids=[1, 2, 3],
        repetition_penalty=1.2,
        logit_bias={9: 1.5, 4: -3.0},
        min_tokens=2,
        bad_words=["quick fox", " hello"],
    )
    _, sampling, _ = read.read(msg, LOCAL)
    assert sampling.repetition_penalty == 1.2 and sampling.min_tokens == 2
    assert sampling.logit_bias == ((4, -3.0), (9, 1.5))
    expected = []
    for text in ("quick fox", " quick fox", "hello", " hello"):
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        if ids not in expected:
            expected.append(ids)
    assert list(sampling.bad_words) == expected and len(expected) >= 3
    with pytest.raises(RequestError, match="needs a tokenizer"):
        Submissions(None, VOCAB, 64, None).read(Submit(key=1, token_ids=[1], bad_words=["x"]), LOCAL)
    with pytest.raises(RequestError, match="logit_bias"):
        read.read(Submit(key=1, token_ids=[1], logit_bias={10**6: 1.0}), LOCAL)
