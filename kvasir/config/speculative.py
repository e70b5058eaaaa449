"""The plan's ``[speculative]`` section: speculative decoding (docs/speculative.md).

Each head proposes draft tokens for its decode rows; every stage computes them in the
row's one pass and the tail keeps the longest prefix its own samples confirm, plus one
token, so the output is the output without drafts. No ``[speculative]``: no drafts.

- ``method``: where drafts come from. "ngram": prompt lookup (the continuation of the
  latest earlier occurrence of the request's last ``ngram_max`` .. ``ngram_min`` tokens in
  its prompt and output; no extra model). "draft": ``draft_model``, a smaller model with
  the model's tokenizer, decoding greedily in each decoding head's process.
- ``num_tokens``: drafts a decode row carries at most.
- ``max_rows``: a batch with more decode rows than this drafts for none of them (the
  stages' cores are busy enough that extra tokens cost throughput).
- ``min_acceptance``: a request whose recent drafts are confirmed less often than this
  only probes (one draft now and then, rarer while rejected) until the model confirms one.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvasir.errors import PlanError

Method = Literal["ngram", "draft"]
MAX_DRAFT_TOKENS = 16
MAX_NGRAM = 16


class SpeculativeSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    method: Method
    num_tokens: int = 4  # drafts a decode row carries at most
    ngram_min: int = 2  # ngram: the shortest suffix looked up
    ngram_max: int = 4  # ngram: the longest (tried first)
    draft_model: str | None = None  # draft: the drafting model's source (same tokenizer)
    max_rows: int = 8  # batches with more decode rows than this draft for none
    min_acceptance: float = 0.3  # below this share of confirmed drafts a request drafts only to probe


def check_speculative(spec: SpeculativeSpec) -> None:
    """The section's values, each against its range and the others."""
    if (spec.method == "draft") != (spec.draft_model is not None):
        raise PlanError(
            'speculative.draft_model names the drafting model, and goes with method = "draft" only'
            if spec.draft_model is not None
            else 'speculative.method = "draft" needs speculative.draft_model: the drafting model\'s source'
        )
    if spec.draft_model is not None and not spec.draft_model.strip():
        raise PlanError("speculative.draft_model must name a model (built-in alias or path), got an empty string")
    if not 1 <= spec.num_tokens <= MAX_DRAFT_TOKENS:
        raise PlanError(f"speculative.num_tokens must be in 1..{MAX_DRAFT_TOKENS}, got {spec.num_tokens}")
    if not 1 <= spec.ngram_min <= spec.ngram_max <= MAX_NGRAM:
        raise PlanError(
            f"speculative.ngram_min ({spec.ngram_min}) and ngram_max ({spec.ngram_max}) must satisfy "
            f"1 <= ngram_min <= ngram_max <= {MAX_NGRAM}"
        )
    if spec.max_rows < 1:
        raise PlanError(f"speculative.max_rows must be >= 1 (decode rows a batch may draft for), got {spec.max_rows}")
    if not 0.0 <= spec.min_acceptance <= 1.0:
        raise PlanError(f"speculative.min_acceptance must be in [0, 1], got {spec.min_acceptance}")
