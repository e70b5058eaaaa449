"""A structured output that ``max_tokens`` would cut still ends complete: near the end of
its budget, each token the tail samples must leave a way to close the grammar in the
tokens that remain, or the first token of such a way is taken instead.

The way to close is found by a greedy walk on the matcher (then rolled back): at each step
the allowed token that closes soonest, until the grammar accepts: the quote that ends the
string the text is in, else the bracket that ends its innermost object or array (the text
is scanned for JSON's strings and brackets as it grows), else by the token's own text
(``}``, ``]``, ``"``, digits, short tokens before long ones, an opening ``{``, ``[`` or
``,`` last). The walk runs only in the last tokens of a budget: within ``MARGIN`` tokens of
the last walk's length every token, within twice that (plus ``FAR``) every ``REFRESH``
tokens, and never before.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

MARGIN = 16  # tokens beyond the closing walk's length where every token is checked
FAR = 64  # beyond twice the walk's length plus this, nothing is checked
REFRESH = 8  # between those two: the walk's length refreshed every this many tokens
WALK_LIMIT = 256  # a closing walk longer than this counts as none
CLOSERS = {ord("}"): 0, ord("]"): 0, ord('"'): 1, **{ord(d): 2 for d in "0123456789"}}
OPENERS = {ord("{"), ord("["), ord(",")}
NONE = np.iinfo(np.int32).max
FIRST = 512  # tokens of lowest rank a walk's step looks at before the whole vocabulary


@dataclass(frozen=True)
class Vocabulary:
    """The engine's tokens as the closing walk sees them."""

    ranks: np.ndarray  # [vocab] int32: lower closes sooner; NONE for special tokens
    texts: list[bytes]  # each token's bytes
    singles: dict[int, int]  # a byte -> the token that is that byte alone
    best: np.ndarray  # the FIRST tokens of lowest rank, in rank order (looked at before the rest)

    @classmethod
    def of(cls, tokenizer, vocab_size: int) -> Vocabulary:
        ranks = np.full(vocab_size, NONE, dtype=np.int32)
        texts = [b""] * vocab_size
        singles: dict[int, int] = {}
        for token in range(min(vocab_size, tokenizer.vocab_size)):
            if tokenizer.is_special_token(token):
                continue
            text = texts[token] = tokenizer.decode_bytes([token])
            if not text:
                continue
            ranks[token] = CLOSERS.get(text[0], 4 if text[0] in OPENERS else 3) * 4096 + min(len(text), 4095)
            if len(text) == 1:
                singles.setdefault(text[0], token)
        return cls(ranks, texts, singles, np.argsort(ranks, kind="stable")[:FIRST])


@dataclass(frozen=True)
class Scan:
    """Where a JSON text stands: inside a string (after a backslash), and its open brackets."""

    in_string: bool = False
    escaped: bool = False
    open: str = ""
    partial: int = 0  # bytes still to come of a character begun (UTF-8)

    def after(self, data: bytes) -> Scan:
        in_string, escaped, stack, partial = self.in_string, self.escaped, self.open, self.partial
        for byte in data:
            partial = max(partial - 1, 0) if 0x80 <= byte < 0xC0 else _continuation(byte)
            if in_string:
                in_string, escaped = (True, False) if escaped else (byte != 34, byte == 92)
            elif byte == 34:
                in_string = True
            elif byte in (123, 91):
                stack += chr(byte)
            elif byte in (125, 93) and stack:
                stack = stack[:-1]
        return replace(self, in_string=in_string, escaped=escaped, open=stack, partial=partial)

    def closer(self) -> int | None:
        """The byte that would close the most: the string's quote, or the innermost bracket."""
        if self.in_string:
            return None if self.escaped else 34
        return (125 if self.open[-1] == "{" else 93) if self.open else None


def bitmask(matcher) -> np.ndarray:
    """The matcher's allowed next tokens, packed: bit ``t % 8`` of byte ``t // 8`` is token ``t``."""
    return np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)


def allowed(words: np.ndarray, size: int) -> np.ndarray:
    """``bitmask``'s bits for the first ``size`` tokens, as booleans."""
    return np.unpackbits(words, bitorder="little")[:size].astype(bool)


def _continuation(byte: int) -> int:
    """How many continuation bytes a UTF-8 character that begins with ``byte`` has."""
    return 1 if 0xC0 <= byte < 0xE0 else 2 if 0xE0 <= byte < 0xF0 else 3 if 0xF0 <= byte < 0xF8 else 0


class Closing:
    """One constrained request's watch on its budget."""

    def __init__(self, matcher, vocabulary: Vocabulary) -> None:
        self.matcher = matcher
        self.vocabulary = vocabulary
        self.scan = Scan()  # the output so far, scanned
        self.length = 0  # the last closing walk's length (0: none yet)
        self.picks = 0
        self.hopeless = False  # no way to close fitted the budget: the rest is sampled freely

    def follow(self, token: int) -> None:
        """The request output ``token`` (the matcher follows it apart)."""
        self.scan = self.scan.after(self._text(token))

    def keep(self, token: int, budget: int) -> int:
        """``token``, or the first token of a way to close when ``token`` would leave none
        within ``budget`` (the tokens left, this one included)."""
        self.picks += 1
        if self.hopeless or budget > 2 * self.length + FAR:
            return token
        if budget > self.length + MARGIN and (self.picks - 1) % REFRESH:
            return token
        if self.length and self.length <= budget and self._inside_string(token):
            return token  # more of a string: the way to close is no longer (its quote, then the same)
        after = self._walk_after(token, budget - 1)
        if after is not None:
            self.length = len(after) + 1
            return token
        now = self._walk(budget, self.scan)
        if not now:  # no way to close within the budget (too short for the grammar): not looked for again
            self.hopeless = True
            return token
        return now[0]

    def _inside_string(self, token: int) -> bool:
        """``token`` is whole characters inside the string the output is in, and leaves it open."""
        text, scan = self._text(token), self.scan
        if not scan.in_string or scan.escaped or scan.partial or b'"' in text or b"\\" in text:
            return False
        return scan.after(text).partial == 0

    def _walk_after(self, token: int, limit: int) -> list[int] | None:
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            return None
        try:
            return self._walk(limit, self.scan.after(self._text(token)))
        finally:
            self.matcher.rollback(1)

    def _walk(self, limit: int, scan: Scan) -> list[int] | None:
        """The greedy way to close within ``limit`` tokens, the matcher left as it was."""
        path: list[int] = []
        try:
            while not (self.matcher.is_accepting() or self.matcher.is_stopped()):
                token = self._next(scan) if len(path) < min(limit, WALK_LIMIT) else None
                if token is None or not self.matcher.consume_token(token):
                    return None
                path.append(token)
                scan = scan.after(self._text(token))
            return path
        finally:
            if path:
                self.matcher.rollback(len(path))

    def _next(self, scan: Scan) -> int | None:
        vocabulary = self.vocabulary
        words = bitmask(self.matcher)
        closer = vocabulary.singles.get(scan.closer() or -1)
        if closer is not None and words[closer >> 3] >> (closer & 7) & 1:
            return closer
        best = vocabulary.best
        hits = np.flatnonzero(words[best >> 3] >> (best & 7) & 1)
        if hits.size:  # the usual case: a closer, a digit or a short token is allowed
            token = int(best[hits[0]])
            return None if vocabulary.ranks[token] == NONE else token
        ranked = np.where(allowed(words, vocabulary.ranks.shape[0]), vocabulary.ranks, NONE)
        token = int(ranked.argmin())
        return None if ranked[token] == NONE else token

    def _text(self, token: int) -> bytes:
        texts = self.vocabulary.texts
        return texts[token] if 0 <= token < len(texts) else b""
