"""What the bridge makes of a client's submission: a prompt's token ids, its sampling
parameters and its prefix-cache namespace, or a RequestError saying what is wrong. Policy
only: no sockets, no state beyond the tokenizer and the plan's limits
(kvasir/sched/validation.py holds the checks).

A request's cache namespace is its tenant's: the CURVE key a remote client authenticated
with, "local" for the daemon's own user on the local socket, or, for a local client
serving others (the HTTP front), the ``tenant`` it names (the front names the API key).
Only local clients may name one. ``cache_salt`` narrows any namespace further; with
``[kv] prefix_share = "all"`` the tenant is left out and only salts separate requests."""

from __future__ import annotations

import msgspec

from kvasir.bridge.detokenizer import encode_chat, encode_text
from kvasir.config.sections import PrefixShare
from kvasir.errors import RequestError
from kvasir.sched.grammar import check_grammar
from kvasir.sched.prefix import namespace_root
from kvasir.sched.validation import check_max_tokens, check_prompt, check_prompt_text, check_sampling
from kvasir.wire.base import MAX_BAD_WORD_TOKENS, MAX_LOGPROBS, Grammar
from kvasir.wire.batch import SamplingParams
from kvasir.wire.client import Submit
from kvasir.wire.decoding import Decoder, Malformed


class _Envelope(msgspec.Struct):
    """Just enough of a client message to answer one that does not decode: its key."""

    type: str = ""
    key: int | None = None


LOCAL = "local"  # the origin of a client on the local socket (the daemon's user)


class Submissions:
    def __init__(
        self, tokenizer, vocab_size: int, max_seq_len: int, max_tokens: int | None, share: PrefixShare = "tenant"
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.max_tokens = max_tokens  # bridge.max_tokens_per_request (None: no ceiling)
        self.share = share  # kv.prefix_share
        self._envelope: Decoder[_Envelope] = Decoder(_Envelope)

    def read(self, msg: Submit, origin: str) -> tuple[list[int], SamplingParams, bytes]:
        """The prompt's ids, the sampling parameters and the prefix-cache root of a
        submission from ``origin`` (LOCAL, or the remote client's "curve:KEY" or "tcp");
        RequestError when refused."""
        root = self.cache_root(msg, origin)
        ids, sampling = self._read(msg)
        return ids, sampling, root

    def cache_root(self, msg: Submit, origin: str) -> bytes:
        if msg.tenant is not None and origin != LOCAL:
            raise RequestError(
                "invalid_request",
                "tenant is for local clients serving others (the HTTP front); a remote client's tenant is its key",
            )
        tenant = origin if msg.tenant is None else f"{LOCAL}/{msg.tenant}"
        return namespace_root(tenant if self.share == "tenant" else "", msg.cache_salt)

    def _read(self, msg: Submit) -> tuple[list[int], SamplingParams]:
        if self.max_tokens is not None:
            check_max_tokens(msg.max_tokens, self.max_tokens)
        for name in ("logprobs", "prompt_logprobs"):  # -1 is the internal "none": a client says None
            value = getattr(msg, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise RequestError(
                    "invalid_request", f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        ids = self._prompt_ids(msg)
        sampling = SamplingParams(
            temperature=msg.temperature,
            top_p=msg.top_p,
            top_k=msg.top_k,
            seed=msg.seed,
            max_tokens=msg.max_tokens,
            stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            logprobs=-1 if msg.logprobs is None else msg.logprobs,
            prompt_logprobs=-1 if msg.prompt_logprobs is None else msg.prompt_logprobs,
            presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty,
            repetition_penalty=msg.repetition_penalty,
            min_p=msg.min_p,
            logit_bias=tuple(sorted(msg.logit_bias.items())),
            min_tokens=msg.min_tokens,
            bad_words=self._bad_words(msg.bad_words),
            grammar=msg.grammar,
            speculative=msg.speculative,
        )
        check_sampling(sampling, self.vocab_size)
        if msg.grammar is not None:
            self._check_grammar(msg.grammar)
        return ids, sampling

    def _check_grammar(self, grammar: Grammar) -> None:
        """A structured output the tail can follow: the model has a fast tokenizer (the
        engine reads its vocabulary) and the grammar compiles."""
        if self.tokenizer is None or not getattr(self.tokenizer, "is_fast", False):
            raise RequestError(
                "invalid_request", "structured output needs the model's fast tokenizer, which it has not"
            )
        check_grammar(grammar)

    def _bad_words(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token ids as the model would write it, alone and after a space
        (as vLLM does): both spellings are barred."""
        if not words:
            return ()
        if self.tokenizer is None:
            raise RequestError("invalid_request", "bad_words needs a tokenizer, which this model has not")
        found: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if len(ids) > MAX_BAD_WORD_TOKENS:
                    raise RequestError(
                        "invalid_request", f"bad word {word[:40]!r} is over {MAX_BAD_WORD_TOKENS} tokens"
                    )
                if ids:
                    found[ids] = None
        return tuple(found)

    def key_of(self, body: bytes) -> int | None:
        """The key of a submission or stats query that did not decode, when it has one."""
        try:
            envelope = self._envelope.decode(body)
        except Malformed:
            return None
        return envelope.key if envelope.type in ("submit", "stats") else None

    def _prompt_ids(self, msg: Submit) -> list[int]:
        if msg.token_ids is not None and msg.prompt is None:
            return check_prompt(msg.token_ids, self.vocab_size, self.max_seq_len)
        if msg.prompt is None or msg.token_ids is not None:
            raise RequestError("invalid_request", "give exactly one of prompt (text) or token_ids")
        if self.tokenizer is None:
            raise RequestError("invalid_request", "this model has no tokenizer: submit token ids instead of text")
        check_prompt_text(msg.prompt, self.max_seq_len)
        if msg.chat:
            ids = encode_chat(self.tokenizer, [{"role": "user", "content": msg.prompt}])
        else:
            ids = encode_text(self.tokenizer, msg.prompt)
        return check_prompt(ids, self.vocab_size, self.max_seq_len)
