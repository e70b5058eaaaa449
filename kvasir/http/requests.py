"""From an OpenAI request to the bridge's submissions: which prompts, how many choices,
and each one's sampling options (the bridge checks their ranges, as for any client)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import msgspec

from kvasir.http.errors import ApiError, invalid
from kvasir.http.fields import CHAT_ONLY, COMPLETION_ONLY, MESSAGE_UNSERVED, UNSERVED, Unserved
from kvasir.http.generation import Submission
from kvasir.http.prompts import Prompt, Prompts
from kvasir.http.reading import OPEN as THINK
from kvasir.http.reading import Reader, Thinking
from kvasir.http.schema import MAX_CHOICES, ChatRequest, CompletionRequest, _Sampling
from kvasir.http.structured import grammar_of
from kvasir.http.tools import ToolPlan, plan_tools
from kvasir.sched.validation import MAX_SEED

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class Served:
    """What the front serves: the model's name and limits."""

    model_name: str
    max_seq_len: int
    max_tokens: int  # a request's max_tokens ceiling
    max_tokens_key: str  # the plan key that sets it (named in the refusal)
    max_choices: int = 16  # http.max_choices: prompts x n of one request
    allow_ignore_eos: bool = False  # http.allow_ignore_eos
    reasoning: bool = False  # http.reasoning = "think": a chat's <think> block is its reasoning_content

    @classmethod
    def of(cls, model_name: str, max_seq_len: int, http_max_tokens: int, bridge_max_tokens: int | None, **rest):
        """The lower of ``http.max_tokens`` and ``bridge.max_tokens_per_request``."""
        if bridge_max_tokens is not None and bridge_max_tokens < http_max_tokens:
            return cls(model_name, max_seq_len, bridge_max_tokens, "bridge.max_tokens_per_request", **rest)
        return cls(model_name, max_seq_len, http_max_tokens, "http.max_tokens", **rest)


@dataclass(frozen=True)
class Planned:
    prompts: list[Prompt]
    submissions: list[Submission]
    stops: list[str]
    include_stop: bool = False  # vLLM's include_stop_str_in_output
    tools: ToolPlan | None = None  # the functions the model may call (their calls are read out of its text)
    thinking: bool | None = None  # reasoning split off: whether the prompt opened the block (None: not split)

    def reader(self) -> Reader | None:
        """A new reader of one choice's text (None: the text is all content)."""
        if self.tools is None and self.thinking is None:
            return None
        thinking = Thinking(self.thinking) if self.thinking is not None else None
        return Reader(thinking, self.tools.parser() if self.tools is not None else None)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(prompt.ids) for prompt in self.prompts)

    @property
    def choices_per_prompt(self) -> int:
        return max(1, len(self.submissions) // max(1, len(self.prompts)))


def plan_completion(req: CompletionRequest, prompts: Prompts, served: Served) -> Planned:
    _common(req, served)
    refuse_unserved(req, COMPLETION_ONLY)
    count = prompts.count(req.prompt)
    if count * req.n > served.max_choices:  # before any text is tokenized
        raise invalid(
            f"{count} prompts x n = {req.n} is {count * req.n} generations: at most "
            f"{served.max_choices} in one request (http.max_choices)",
            "n",
        )
    given = prompts.completion(req.prompt)
    max_tokens = req.max_tokens if req.max_tokens is not None else min(COMPLETION_MAX_TOKENS, served.max_tokens)
    _check_max_tokens(max_tokens, served, "max_tokens")
    prompt_logprobs = req.logprobs if req.echo else None  # echo with logprobs scores the prompt too
    return _planned(req, given, [max_tokens] * len(given), req.logprobs, prompt_logprobs)


def plan_chat(req: ChatRequest, prompts: Prompts, served: Served) -> Planned:
    _common(req, served)
    refuse_unserved(req, CHAT_ONLY)
    for k, message in enumerate(req.messages):
        refuse_unserved(message, MESSAGE_UNSERVED, f"messages[{k}].")
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs needs logprobs = true", "top_logprobs")
    tools = plan_tools(req, prompts.tool_style)
    prompt = prompts.chat(
        req.messages,
        {
            "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message,
            "template_kwargs": req.chat_template_kwargs,
        },
        tools.template_tools() if tools is not None else None,
    )
    if req.n > served.max_choices:
        raise invalid(
            f"n = {req.n} is more than {served.max_choices} generations in one request (http.max_choices)", "n"
        )
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:  # the rest of the context, within the daemon's ceiling
        max_tokens = min(max(1, served.max_seq_len - len(prompt.ids)), served.max_tokens)
    _check_max_tokens(max_tokens, served, param)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    planned = _planned(req, [prompt], [max_tokens], logprobs, None, tools)
    if not served.reasoning:
        return planned
    opened = prompts.decode(prompt.ids[-8:]).rstrip().endswith(THINK)  # a template that starts the thinking
    return replace(planned, thinking=opened)


def _common(req: _Sampling, served: Served) -> None:
    refuse_unserved(req, UNSERVED)
    if req.model is not None and req.model != served.model_name:
        raise ApiError(
            "model_not_found",
            f"the model {req.model!r} does not exist: this server serves {served.model_name!r}",
            "model",
        )
    if not 1 <= req.n <= MAX_CHOICES:
        raise invalid(f"n must be in [1, {MAX_CHOICES}], got {req.n}", "n")
    if req.ignore_eos and not served.allow_ignore_eos:
        raise invalid(
            "ignore_eos = true is not allowed here: it runs to max_tokens whatever the model says "
            "(a plan enables it with http.allow_ignore_eos = true)",
            "ignore_eos",
        )


def refuse_unserved(body: Any, entries: tuple[Unserved, ...], where: str = "") -> None:
    """A 400 naming the first of ``entries`` that ``body`` gives at a value that would change the output."""
    for entry in entries:
        value = getattr(body, entry.name)
        if entry.refused(value):
            param = f"{where}{entry.name}"
            shown = msgspec.json.encode(value).decode(errors="replace")
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise invalid(f"{param}: {entry.why} (got {shown})", param)


def _check_max_tokens(max_tokens: int, served: Served, param: str) -> None:
    if max_tokens > served.max_tokens:
        raise invalid(
            f"{param} = {max_tokens} is over this server's ceiling of {served.max_tokens} ({served.max_tokens_key})",
            param,
        )


def _planned(
    req: _Sampling,
    given: list[Prompt],
    max_tokens: list[int],
    logprobs: int | None,
    prompt_logprobs: int | None,
    tools: ToolPlan | None = None,
) -> Planned:
    submissions = []
    shared = {**_shaping(req, tools), "logprobs": logprobs, "prompt_logprobs": prompt_logprobs}  # every choice's
    for k, (prompt, limit) in enumerate(zip(given, max_tokens)):
        for j in range(req.n):
            options = {**_options(req, limit, j), **shared}
            submissions.append(Submission(k * req.n + j, prompt.ids, options))
    return Planned(given, submissions, req.stops, req.include_stop_str_in_output, tools)


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
        "speculative": req.speculative,
        "cache_salt": req.cache_salt,
        "session": req.prompt_cache_key,  # affinity: requests with one key stay on one instance
    }


def _shaping(req: _Sampling, tools: ToolPlan | None) -> dict[str, Any]:
    """The logits' processing the request asks for (the bridge checks what the schema does not)."""
    grammar, held = grammar_of(req), tools.grammar if tools is not None else None
    if grammar is not None and held is not None:
        raise invalid(
            "a structured output and a tool_choice that holds the answer to calls cannot both shape it: give one",
            "tool_choice",
        )
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()) or len(key) > 10:  # "²" is a digit to isdigit(), not to int()
            raise invalid(f"logit_bias keys are token ids (ASCII decimal digits), got {key[:20]!r}", "logit_bias")
        bias[int(key)] = value
    return {
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "repetition_penalty": req.repetition_penalty if req.repetition_penalty is not None else 1.0,
        "min_p": req.min_p or 0.0,
        "logit_bias": bias,
        "min_tokens": req.min_tokens or 0,
        "bad_words": req.bad_words or [],
        "skip_special_tokens": req.skip_special_tokens,
        "grammar": grammar if grammar is not None else held,
    }
