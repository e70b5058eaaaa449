"""Every request field the OpenAI and vLLM schemas define that Kvasir does not (yet) honour.

Nothing that would change the output is ignored: each field here is accepted only at a
value that changes nothing (``null``, a zero penalty, ``false``...) and otherwise refused
with a 400 naming it (``param``); a field no schema here defines is refused too
(kvasir/http/errors.py ``from_validation``); kvasir/http/requests.py checks the values. Fields with no effect on the output at all
(``user``, ``metadata``, ``store``...) are accepted and ignored: ``IGNORED``.

The request Structs (kvasir/http/schema.py) declare each of these names, typed as any
JSON value, so that a value is checked here with a reason rather than as an unknown key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# no effect on what the model generates: accepted, never acted on
IGNORED = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_retention", "request_id")


@dataclass(frozen=True)
class Unserved:
    """A field Kvasir does not serve: ``why`` in words, ``neutral`` the values that change nothing."""

    name: str
    why: str
    neutral: tuple[Any, ...] = (None,)

    def refused(self, value: Any) -> bool:
        return not any(value == quiet and type(value) is type(quiet) for quiet in self.neutral)


FUNCTIONS = "the deprecated functions API is not served: give tools and tool_choice"

UNSERVED: tuple[Unserved, ...] = (
    # OpenAI completions
    Unserved("best_of", "best_of is not served (sample n choices instead)", (None, 1)),
    Unserved("suffix", "insertion after a suffix is not served", (None, "")),
    # OpenAI chat
    Unserved("audio", "audio output is not served: this is a text model"),
    Unserved("modalities", "only text output is served", (None, ["text"])),
    Unserved("prediction", "predicted outputs are not served"),
    Unserved("reasoning_effort", "reasoning effort is not served"),
    Unserved("verbosity", "verbosity is not served"),
    Unserved("web_search_options", "web search is not served"),
    Unserved("functions", FUNCTIONS, (None, [])),
    Unserved("function_call", FUNCTIONS, (None, "none")),
    # vLLM's sampling extensions
    Unserved("use_beam_search", "beam search is not served", (None, False)),
    Unserved("length_penalty", "length_penalty is for beam search, which is not served", (None, 1, 1.0)),
    Unserved("allowed_token_ids", "allowed_token_ids is not served"),
    Unserved("spaces_between_special_tokens", "special tokens are always skipped in the text", (None, True)),
    Unserved("truncate_prompt_tokens", "prompts are never truncated: a prompt too long is refused"),
    Unserved("prompt_logprobs", "prompt log-probabilities come with echo and logprobs (completions)"),
    Unserved("logits_processors", "logits processors are not served"),
    Unserved("return_tokens_as_token_ids", "tokens are returned as text", (None, False)),
    Unserved("priority", "request priorities are not served", (None, 0)),
    Unserved("kv_transfer_params", "KV transfer between servers is not served"),
    Unserved("vllm_xargs", "vLLM's extra arguments are not served"),
    Unserved("guided_decoding_backend", "the structured output engine is llguidance, not chosen per request"),
    Unserved("guided_whitespace_pattern", "the JSON whitespace is the engine's, not chosen per request"),
    # vLLM's chat extensions
    Unserved("documents", "documents for the chat template are not served"),
    # a template is code the front runs: a request's own is refused (as vLLM does unless trusted)
    Unserved("chat_template", "a request's own chat template is not run: the model's is used"),
    Unserved("mm_processor_kwargs", "this model takes text only", (None, {})),
)
# per endpoint: chat's echo (vLLM: prepend the last message) is not the completions echo
# that is served; a plain prompt gets the model's special tokens (a BOS), a chat's template
# places its own
SPECIAL = "the special tokens a prompt gets are not chosen per request"
CHAT_ONLY = (
    Unserved("echo", "echo is served by /v1/completions only", (None, False)),
    Unserved("add_special_tokens", SPECIAL, (None, False)),
)
COMPLETION_ONLY = (Unserved("add_special_tokens", SPECIAL, (None, True)),)

# message fields that are not served
MESSAGE_UNSERVED = (
    Unserved("function_call", FUNCTIONS),
    Unserved("refusal", "an assistant's refusal in a message is not served", (None, "")),
    Unserved("audio", "audio is not served: this is a text model"),
)


def declared(entries: tuple[Unserved, ...], *, ignored: tuple[str, ...] = ()) -> list[tuple[str, Any, Any]]:
    """The Struct fields (``msgspec.defstruct``) that let each name decode as any JSON value."""
    return [(name, Any, None) for name in ignored] + [(entry.name, Any, None) for entry in entries]
