"""The OpenAI request and response bodies the HTTP front speaks, as msgspec Structs.

Requests refuse fields they do not know and wrong types with a message naming the field;
every field of the OpenAI and vLLM schemas Kvasir does not honour is declared (any JSON
value) and refused where its value would change the output (kvasir/http/fields.py).
Responses and stream chunks are encoded straight from Structs (one encode per token on
the streaming path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from kvasir.http.fields import IGNORED, MESSAGE_UNSERVED, UNSERVED, declared
from kvasir.sched.validation import MAX_BIAS, MAX_PENALTY, MAX_REPETITION_PENALTY, MAX_SEED
from kvasir.wire.base import MAX_BAD_WORD_CHARS, MAX_BAD_WORD_TEXTS, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS
from kvasir.wire.client import MAX_PROMPT_CHARS, MAX_PROMPT_TOKENS, Namespace

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # one stop string
MAX_CHOICES = 16  # n
MAX_PROMPTS = 256  # prompts in one completions request
MAX_MESSAGES = 4096
MAX_INT32 = (1 << 31) - 1

Penalty = Annotated[float, msgspec.Meta(ge=-MAX_PENALTY, le=MAX_PENALTY)]
Bias = Annotated[float, msgspec.Meta(ge=-MAX_BIAS, le=MAX_BIAS)]
BadWord = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_BAD_WORD_CHARS)]

# integers as the daemon can hold them: a value out of range is a 400 naming its field, never
# an overflow further in (msgpack holds 64 bits, a tokenizer 32)
Count = Annotated[int, msgspec.Meta(ge=1, le=MAX_INT32)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT32)]
NumLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]
TokenIds = Annotated[list[TokenId], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)]
# one text, or a list of: texts, token ids (one prompt), token-id lists (msgspec allows one
# list type in a union: kvasir/http/prompts.py tells the list forms apart)
PromptForm = Text | Annotated[list[Text | TokenId | TokenIds], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]
StopForm = (
    Annotated[str, msgspec.Meta(max_length=MAX_STOP_CHARS)]
    | Annotated[
        list[Annotated[str, msgspec.Meta(max_length=MAX_STOP_CHARS)]], msgspec.Meta(max_length=MAX_STOP_STRINGS)
    ]
    | None
)


class JsonSchemaFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str = "output"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """vLLM's: exactly one of these."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark or GBNF
    json_object: bool | None = None


MAX_TOOLS = 128
ToolName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (none: any object)
    strict: bool | None = None  # with tool_choice auto: a call the model starts follows the schema


class ToolSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCallIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A call an assistant message made earlier in the conversation."""

    function: CalledFunction
    id: str | None = None
    type: Literal["function"] = "function"


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False  # vLLM's usage in every chunk: not served


if TYPE_CHECKING:  # their fields are read by name (kvasir/http/requests.py refuse_unserved)

    class _Unserved(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True): ...

    class _MessageUnserved(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True): ...

else:
    STRICT = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True}
    _Unserved = msgspec.defstruct("_Unserved", declared(UNSERVED, ignored=(*IGNORED, "add_special_tokens")), **STRICT)
    _MessageUnserved = msgspec.defstruct("_MessageUnserved", declared(MESSAGE_UNSERVED), **STRICT)


class _Sampling(_Unserved, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The fields completions and chat share (and, from ``_Unserved``, those not served)."""

    model: str | None = None
    max_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=MAX_INT32)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=-MAX_SEED - 1, le=MAX_SEED)] | None = None
    stop: StopForm = None
    stop_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    n: int = 1  # checked in kvasir/http/requests.py (1 to 16), before anything uses it
    ignore_eos: bool = False
    speculative: bool = True  # Kvasir's: false turns the plan's speculative decoding off for it (same output)
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_cache_key: Namespace | None = None  # OpenAI's: requests giving the same key stay on one instance
    # the logits' processing (kvasir/stage/logits.py); the bridge checks token ids against the model
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0, le=MAX_REPETITION_PENALTY)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    logit_bias: Annotated[dict[str, Bias], msgspec.Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_INT32)] | None = None
    bad_words: Annotated[list[BadWord], msgspec.Meta(max_length=MAX_BAD_WORD_TEXTS)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended a choice stays in its text
    # structured output (kvasir/http/structured.py): OpenAI's, vLLM's, and vLLM's older names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    return_token_ids: bool = False  # vLLM's extension: each choice's output token ids (whole responses)
    cache_salt: Namespace | None = None  # vLLM's: share cached prompt blocks only with requests giving the same salt

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling, frozen=True, kw_only=True, forbid_unknown_fields=True):
    prompt: PromptForm
    echo: bool = False
    logprobs: NumLogprobs | None = None


class TextPart(msgspec.Struct, frozen=True):
    type: str = "text"
    text: str = ""


class ChatMessage(_MessageUnserved, frozen=True, kw_only=True, forbid_unknown_fields=True):
    role: str
    content: Text | Annotated[list[TextPart], msgspec.Meta(max_length=MAX_MESSAGES)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCallIn], msgspec.Meta(max_length=MAX_TOOLS)] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool message's: the call it answers
    reasoning_content: Text | None = None  # an assistant's earlier thinking: to the template (which may drop it)


class ChatRequest(_Sampling, frozen=True, kw_only=True, forbid_unknown_fields=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(max_length=MAX_MESSAGES)]
    max_completion_tokens: Count | None = None  # the newer name of max_tokens
    echo: Any = None  # vLLM's chat echo: refused unless false (kvasir/http/fields.py)
    # vLLM's template options (kvasir/bridge/detokenizer.py encode_chat)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Annotated[dict[str, Any], msgspec.Meta(max_length=64)] | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    # tool calling (kvasir/http/tools.py)
    tools: Annotated[list[ToolSpec], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None  # none given: "auto" with tools
    parallel_tool_calls: bool = True


# -- responses ------------------------------------------------------------------------------
class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int  # prompt tokens reused from the prefix cache


class UsageBody(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


FinishReason = Literal["stop", "length", "tool_calls"] | None


class CompletionChoice(msgspec.Struct, frozen=True, omit_defaults=True):
    index: int
    text: str
    logprobs: Any
    finish_reason: FinishReason
    token_ids: list[int] | None = None  # with return_token_ids (vLLM's extension)


class Completion(msgspec.Struct, frozen=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: UsageBody | None = None


class FunctionOut(msgspec.Struct, frozen=True):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCallOut(msgspec.Struct, frozen=True):
    id: str
    function: FunctionOut
    type: str = "function"


class ToolCallDelta(msgspec.Struct, frozen=True):
    """A whole call in one stream chunk (``index``: the call's place in the choice)."""

    index: int
    id: str
    function: FunctionOut
    type: str = "function"


class AssistantMessage(msgspec.Struct, frozen=True):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET
    reasoning_content: str | None | msgspec.UnsetType = msgspec.UNSET  # with [http] reasoning = "think"


class ChatChoice(msgspec.Struct, frozen=True, omit_defaults=True):
    index: int
    message: AssistantMessage
    logprobs: Any
    finish_reason: FinishReason
    token_ids: list[int] | None = None  # with return_token_ids (vLLM's extension)


class ChatCompletion(msgspec.Struct, frozen=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageBody
    object: str = "chat.completion"


class Delta(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(msgspec.Struct, frozen=True):
    index: int
    delta: Delta
    logprobs: Any
    finish_reason: FinishReason


class ChatChunk(msgspec.Struct, frozen=True):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: UsageBody | None = None


class ModelCard(msgspec.Struct, frozen=True):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "kvasir"


class ModelList(msgspec.Struct, frozen=True):
    data: list[ModelCard]
    object: str = "list"


class ErrorDetail(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct, frozen=True):
    error: ErrorDetail
