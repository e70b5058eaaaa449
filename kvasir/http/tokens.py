"""vLLM's ``/tokenize`` and ``/detokenize``: a prompt or chat messages as the model's token
ids (exactly as a generation request would give them to the model), and ids back as text;
and ``/version``."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from kvasir import __version__
from kvasir.http.errors import ApiError, invalid
from kvasir.http.prompts import Prompts
from kvasir.http.schema import ChatMessage, Text, TokenIds


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One of ``prompt`` (text) or ``messages`` (through the chat template)."""

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # a prompt's: default true; messages: the template places them
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Annotated[dict[str, Any], msgspec.Meta(max_length=64)] | None = None
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct, frozen=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(msgspec.Struct, frozen=True):
    prompt: str


class Version(msgspec.Struct, frozen=True):
    version: str = __version__


def tokenize(req: TokenizeRequest, prompts: Prompts, model_name: str) -> TokenizeResponse:
    """The ids a generation request with this prompt or these messages would give the model."""
    _check_model(req.model, model_name)
    if (req.prompt is None) == (req.messages is None):
        raise invalid("give one of prompt or messages", "prompt")
    if req.messages is not None:
        if req.add_special_tokens:
            raise invalid("messages get the special tokens their chat template places", "add_special_tokens")
        options = {
            "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message,
            "template_kwargs": req.chat_template_kwargs,
        }
        ids = prompts.chat(req.messages, options).ids
    else:
        ids = prompts.text_ids(req.prompt or "", req.add_special_tokens is not False)
    strs = [prompts.token_text(tok) for tok in ids] if req.return_token_strs else None
    return TokenizeResponse(len(ids), prompts.max_seq_len, ids, strs)


def detokenize(req: DetokenizeRequest, prompts: Prompts, model_name: str) -> DetokenizeResponse:
    _check_model(req.model, model_name)
    bad = next((tok for tok in req.tokens if tok >= prompts.vocab_size), None)
    if bad is not None:
        raise invalid(f"token id {bad} is not a token of this model (0 <= id < {prompts.vocab_size})", "tokens")
    if prompts.tokenizer is None:
        raise invalid("this model has no tokenizer: its ids have no text")
    return DetokenizeResponse(prompts.decode(list(req.tokens)))


def _check_model(model: str | None, served: str) -> None:
    if model is not None and model != served:
        raise ApiError("model_not_found", f"the model {model!r} does not exist: this server serves {served!r}", "model")
