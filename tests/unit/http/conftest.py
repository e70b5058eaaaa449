"""Fixtures of the HTTP front's unit tests."""

from __future__ import annotations

import pytest

from tests.support.models import save_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    """A small real tokenizer with a chat template (tests/support/models.py)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    save_tiny_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)
