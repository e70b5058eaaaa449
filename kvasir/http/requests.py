"""From an OpenAI request to the bridge's submissions: which prompts, how many choices,
and each one's sampling options (the bridge checks their ranges, as for any client)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvasir.http.errors import ApiError, invalid
from kvasir.http.generation import Submission
from kvasir.http.prompts import Prompt, Prompts
from kvasir.http.schema import MAX_CHOICES, ChatRequest, CompletionRequest, _Sampling
from kvasir.wire.validation import MAX_SEED

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_SUBMISSIONS = 256  # choices of one request, all prompts together (bridge.max_per_client's default)


@dataclass(frozen=True)
class Served:
    """What the front serves: the model's name and limits."""

    model_name: str
    max_seq_len: int
    max_tokens: int | None  # bridge.max_tokens_per_request (None: no ceiling)


@dataclass(frozen=True)
class Planned:
    prompts: list[Prompt]
    submissions: list[Submission]
    stops: list[str]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(prompt.ids) for prompt in self.prompts)

    @property
    def choices_per_prompt(self) -> int:
        return max(1, len(self.submissions) // max(1, len(self.prompts)))


def plan_completion(req: CompletionRequest, prompts: Prompts, served: Served) -> Planned:
    _common(req, served)
    given = prompts.completion(req.prompt)
    if len(given) * req.n > MAX_SUBMISSIONS:
        raise invalid(f"{len(given)} prompts x n = {req.n} choices is more than {MAX_SUBMISSIONS} in one request", "n")
    max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETION_MAX_TOKENS
    prompt_logprobs = req.logprobs if req.echo else None  # echo with logprobs scores the prompt too
    return _planned(req, given, [max_tokens] * len(given), req.logprobs, prompt_logprobs)


def plan_chat(req: ChatRequest, prompts: Prompts, served: Served) -> Planned:
    _common(req, served)
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs needs logprobs = true", "top_logprobs")
    prompt = prompts.chat(req.messages)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:  # the rest of the context, within the daemon's ceiling
        max_tokens = max(1, served.max_seq_len - len(prompt.ids))
        if served.max_tokens is not None:
            max_tokens = min(max_tokens, served.max_tokens)
    return _planned(req, [prompt], [max_tokens], (req.top_logprobs or 0) if req.logprobs else None, None)


def _common(req: _Sampling, served: Served) -> None:
    if req.model is not None and req.model != served.model_name:
        raise ApiError(
            "model_not_found",
            f"the model {req.model!r} does not exist: this server serves {served.model_name!r}",
            "model",
        )
    if not 1 <= req.n <= MAX_CHOICES:
        raise invalid(f"n must be in [1, {MAX_CHOICES}], got {req.n}", "n")


def _planned(
    req: _Sampling, given: list[Prompt], max_tokens: list[int], logprobs: int | None, prompt_logprobs: int | None
) -> Planned:
    submissions = []
    for k, (prompt, limit) in enumerate(zip(given, max_tokens)):
        for j in range(req.n):
            options = {**_options(req, limit, j), "logprobs": logprobs, "prompt_logprobs": prompt_logprobs}
            submissions.append(Submission(k * req.n + j, prompt.ids, options))
    return Planned(given, submissions, req.stops)


def _options(req: _Sampling, max_tokens: int, j: int) -> dict[str, Any]:
    """One choice's ``AsyncClient.submit`` keywords. The j-th of ``n`` choices with a seed
    draws with seed + j: the same request gives the same choices, and they differ."""
    seed = req.seed
    if seed is not None and not isinstance(seed, bool) and 0 <= seed <= MAX_SEED:
        seed = (seed + j) % (MAX_SEED + 1)
    top_k = req.top_k if req.top_k is not None else 0
    return {
        "max_tokens": max_tokens,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "top_k": 0 if top_k == -1 else top_k,  # vLLM's -1: no top-k
        "seed": seed,
        "stop_token_ids": req.stop_token_ids or [],
        "ignore_eos": req.ignore_eos,
    }
