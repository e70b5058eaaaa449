"""Tokenizers: loading a model folder's, and incremental detokenization (text deltas as
tokens arrive, never broken UTF-8)."""

from __future__ import annotations

from pathlib import Path


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Each token's text is decoded in the context of the previous few tokens (so spaces
    and merges come out right); a delta ending in U+FFFD — a multi-byte character whose
    remaining bytes are in the next token — is held back until it is complete.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the decoding context
        self._read = 0  # tokens whose text has been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        after = decode(self.ids[self._prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix = self._read
        self._read = len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """The text still held back (at the end of a request), complete or not."""
        before = self.tokenizer.decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self._prefix :], skip_special_tokens=True)
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]


def load_tokenizer(folder: Path | None):
    """The model folder's tokenizer, or None when it has none (token ids only)."""
    if folder is None or not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
