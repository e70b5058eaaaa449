"""Tokenizers: loading a model folder's, turning texts and chat messages into prompt ids
(the bridge and the HTTP front tokenize the same way), and incremental detokenization
(text deltas as tokens arrive, never broken UTF-8)."""

from __future__ import annotations

from kvasir.errors import RequestError
from kvasir.model.tokenizer import load_tokenizer

__all__ = ["IncrementalDetokenizer", "StreamDetokenizer", "detokenizer", "encode_chat", "encode_text", "load_tokenizer"]


def detokenizer(tokenizer, skip_special_tokens: bool = True) -> IncrementalDetokenizer | StreamDetokenizer:
    """The fastest exact detokenizer for ``tokenizer``: the tokenizers library's own
    streaming decoder where it is a fast tokenizer (about 6x less time per token on
    SmolLM2's), the context-decoding one otherwise."""
    backend = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        return IncrementalDetokenizer(tokenizer, skip_special_tokens)
    return StreamDetokenizer(tokenizer, backend, skip_special_tokens)


class StreamDetokenizer:
    """Text deltas by ``tokenizers.decoders.DecodeStream``, which holds a token back until
    its bytes make whole characters; what it still holds at the end is decoded as it is."""

    def __init__(self, tokenizer, backend, skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.backend = backend
        self.skip = skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.held: list[int] = []  # tokens since the last text (an incomplete character, or skipped)

    def push(self, token_id: int) -> str:
        text = self.stream.step(self.backend, token_id)
        if text is None:
            self.held.append(token_id)
            return ""
        self.held.clear()
        return text

    def flush(self) -> str:
        """The text still held back (at the end of a request), complete or not."""
        held, self.held = self.held, []
        return self.tokenizer.decode(held, skip_special_tokens=self.skip) if held else ""


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Each token's text is decoded in the context of the previous few tokens (so spaces
    and merges come out right); a delta ending in U+FFFD — a multi-byte character whose
    remaining bytes are in the next token — is held back until it is complete.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens  # leave special tokens (end of sequence...) out of the text
        self.ids: list[int] = []
        self._prefix = 0  # start of the decoding context
        self._read = 0  # tokens whose text has been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], skip_special_tokens=self.skip)
        after = decode(self.ids[self._prefix :], skip_special_tokens=self.skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix = self._read
        self._read = len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """The text still held back (at the end of a request), complete or not."""
        before = self.tokenizer.decode(self.ids[self._prefix : self._read], skip_special_tokens=self.skip)
        after = self.tokenizer.decode(self.ids[self._prefix :], skip_special_tokens=self.skip)
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]


def encode_text(tokenizer, text: str) -> list[int]:
    """A plain prompt's ids, with the model's special tokens (a BOS where it has one)."""
    return list(tokenizer.encode(text, add_special_tokens=True))


# apply_chat_template's own parameters: never set through a request's template variables
RESERVED_TEMPLATE_KWARGS = frozenset(
    "conversation messages tools documents chat_template add_generation_prompt continue_final_message tokenize "
    "padding truncation max_length return_tensors return_dict return_assistant_tokens_mask tokenizer_kwargs".split()
)


def encode_chat(
    tokenizer,
    messages: list[dict[str, str]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
) -> list[int]:
    """Chat messages through the model's chat template (or ``chat_template``), ready for
    the assistant's turn unless ``add_generation_prompt`` is false, or with the last
    message left open (``continue_final_message``); ``template_kwargs``: the template's
    own variables (e.g. ``enable_thinking``); ``tools``: function definitions for a
    template that renders them. RequestError when the model has no template
    or the template refuses the messages."""
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise RequestError("invalid_request", "this model has no chat template")
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            tools=tools or None,
            tokenize=True,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # a template may raise anything (jinja2's errors, its own raise_exception)
        raise RequestError("invalid_request", f"the chat template refused the messages: {exc}") from None
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
