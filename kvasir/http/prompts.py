"""Prompts of HTTP requests as token ids: the four forms of a completions ``prompt`` and a
chat's ``messages`` through the model's template. The front tokenizes (the bridge then
only checks the ids), exactly as the bridge tokenizes a text or chat submission
(kvasir/bridge/detokenizer.py), so either door gives the model the same tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvasir.bridge.detokenizer import RESERVED_TEMPLATE_KWARGS, encode_chat, encode_text
from kvasir.errors import RequestError
from kvasir.http.errors import ApiError, invalid
from kvasir.http.schema import MAX_PROMPTS, ChatMessage, PromptForm
from kvasir.http.tools import ToolStyle, prompted
from kvasir.sched.validation import check_prompt_text

ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str | None  # as given, when it was text (echo returns it unchanged)


class Prompts:
    """The model's tokenizer (None: token ids only), the length it must fit, and how its
    template takes tools (kvasir/http/tools.py ``tool_style``; None: it cannot)."""

    def __init__(self, tokenizer, max_seq_len: int, vocab_size: int, tool_style: ToolStyle | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.tool_style = tool_style

    @staticmethod
    def count(prompt: PromptForm) -> int:
        """How many prompts ``prompt`` holds (known before anything is tokenized)."""
        if isinstance(prompt, str) or not prompt or all(isinstance(item, int) for item in prompt):
            return 1
        return len(prompt)

    def completion(self, prompt: PromptForm) -> list[Prompt]:
        """A string, a list of strings, a list of ids or a list of id lists."""
        if isinstance(prompt, str):
            return [self._text(prompt)]
        if not prompt:
            raise invalid("prompt is empty", "prompt")
        if all(isinstance(item, int) for item in prompt):
            return [self._ids(prompt)]  # type: ignore[arg-type]
        if len(prompt) > MAX_PROMPTS:
            raise invalid(f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}", "prompt")
        if all(isinstance(item, str) for item in prompt):
            return [self._text(item) for item in prompt]  # type: ignore[arg-type]
        if all(isinstance(item, list) for item in prompt):
            return [self._ids(item) for item in prompt]  # type: ignore[arg-type]
        raise invalid(
            "prompt must be a string, a list of strings, a list of token ids or a list of such lists", "prompt"
        )

    def chat(
        self, messages: list[ChatMessage], template: dict[str, Any] | None = None, tools: list[dict] | None = None
    ) -> Prompt:
        """``template``: encode_chat's options (add_generation_prompt, continue_final_message,
        chat_template, template_kwargs); ``tools``: the functions the model may call."""
        if not messages:
            raise invalid("messages is empty: give at least one message", "messages")
        plain = [self._message(k, message) for k, message in enumerate(messages)]
        said = (m["content"] + m.get("name", "") + json.dumps(m.get("tool_calls", "")) for m in plain)
        self._check("".join(said) + json.dumps(tools or ""), "messages")
        if self.tool_style is not None and not self.tool_style.native:
            plain, tools = prompted(plain, tools), None  # the template ignores tools: Kvasir writes them in
        options = {**(template or {}), "tools": tools}
        if options.get("continue_final_message") and options.get("add_generation_prompt", True):
            raise invalid(
                "continue_final_message leaves the last message open: give add_generation_prompt = false with it",
                "continue_final_message",
            )
        bad = sorted(set(options.get("template_kwargs") or {}) & RESERVED_TEMPLATE_KWARGS)
        if bad:
            raise invalid(
                f"chat_template_kwargs may not set {', '.join(bad)}: give it as its own field", "chat_template_kwargs"
            )
        return Prompt(self._encode(lambda: encode_chat(self._need(), plain, **options)), None)

    def text_ids(self, text: str, special: bool = True) -> list[int]:
        """A text's ids, with the model's special tokens (a BOS) unless ``special`` is false."""
        self._check(text, "prompt")
        return self._encode(lambda: list(self._need().encode(text, add_special_tokens=special)))

    def token_text(self, token: int) -> str:
        """One token's text, as logprobs name it ("token_id:N" for a model without a tokenizer)."""
        if self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """A prompt's text (echo of a prompt given as ids)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else ""

    def _ids(self, ids: list[int]) -> Prompt:
        """Ids as given; each a token of the model (echo turns them into text here)."""
        bad = next((tok for tok in ids if not 0 <= tok < self.vocab_size), None)
        if bad is not None:
            raise invalid(f"prompt token id {bad} is not a token of this model (0 <= id < {self.vocab_size})", "prompt")
        return Prompt(list(ids), None)

    def _text(self, text: str) -> Prompt:
        self._check(text, "prompt")
        return Prompt(self._encode(lambda: encode_text(self._need(), text)), text)

    def _check(self, text: str, param: str) -> None:
        try:
            check_prompt_text(text, self.max_seq_len)
        except RequestError as exc:
            raise ApiError(exc.code, exc.message, param) from None

    def _need(self):
        if self.tokenizer is None:
            raise RequestError("invalid_request", "this model has no tokenizer: give the prompt as token ids")
        return self.tokenizer

    @staticmethod
    def _encode(encode) -> list[int]:
        try:
            return encode()
        except RequestError as exc:
            raise ApiError(exc.code, exc.message) from None

    @staticmethod
    def _message(k: int, message: ChatMessage) -> dict[str, Any]:
        if message.role not in ROLES:
            raise invalid(f"messages[{k}].role = {message.role!r} is not one of {', '.join(ROLES)}", "messages")
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise invalid(f"messages[{k}].content: only text parts are served by this model", "messages")
            content = "".join(part.text for part in content)
        plain: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:  # for templates that render it (others leave it out)
            plain["name"] = message.name
        if message.tool_call_id is not None:
            plain["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None:
            plain["reasoning_content"] = message.reasoning_content
        if message.tool_calls:
            plain["tool_calls"] = [_called(k, j, call) for j, call in enumerate(message.tool_calls)]
        return plain


def _called(k: int, j: int, call) -> dict[str, Any]:
    """An earlier call as templates take it: its arguments a dict (they render them as JSON)."""
    param = f"messages[{k}].tool_calls[{j}].function.arguments"
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        raise invalid(f"{param} is not JSON", param) from None
    if not isinstance(arguments, dict):
        raise invalid(f"{param} is not a JSON object", param)
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id or f"call_{j}", "type": "function", "function": function}
