"""A model folder's tokenizer, loaded the one way every process that needs it does (the
bridge and the HTTP front to tokenize and detokenize, the tail for structured output)."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(folder: Path | None):
    """The model folder's tokenizer, or None when it has none (token ids only)."""
    if folder is None or not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
