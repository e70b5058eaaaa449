"""A chat choice's text read as it streams (kvasir/http/reading.py): the thinking apart
from the answer, then tool calls out of the answer, whatever the text's cut into pieces."""

from __future__ import annotations

import json
import random

import pytest

from kvasir.http.reading import Reader, Thinking
from kvasir.http.toolcalls import HermesCalls


def read(reader: Reader, text: str, seed: int) -> tuple[str, str, list[str]]:
    """Reasoning, content and the names of the calls."""
    chooser = random.Random(seed)
    reasoning, content, calls, at = "", "", [], 0
    while at < len(text):
        step = chooser.randint(1, 6)
        said = reader.read(text[at : at + step])
        at += step
        reasoning, content, calls = reasoning + said.reasoning, content + said.content, calls + said.calls
    said = reader.read("", end=True)
    reasoning, content, calls = reasoning + said.reasoning, content + said.content, calls + said.calls
    return reasoning, content, [call.name for call in calls]


@pytest.mark.parametrize("seed", range(6))
def test_the_thinking_block_is_the_reasoning(seed):
    text = "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nIt is 4."
    assert read(Reader(Thinking(False), None), text, seed) == ("\nThe user wants 2+2. That is 4.\n", "It is 4.", [])


@pytest.mark.parametrize("seed", range(4))
def test_a_block_the_template_opened_and_an_answer_without_one(seed):
    assert read(Reader(Thinking(True), None), "so: 4</think>\n4", seed) == ("so: 4", "4", [])
    assert read(Reader(Thinking(False), None), "Just <think> 4", seed) == ("", "Just <think> 4", [])
    assert read(Reader(Thinking(False), None), "<think>cut short", seed) == ("cut short", "", [])  # max_tokens


@pytest.mark.parametrize("seed", range(4))
def test_calls_after_the_thinking(seed):
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    reader = Reader(Thinking(False), HermesCalls())
    reasoning, content, calls = read(reader, f"<think>I need the time.</think>\n{call}", seed)
    assert (reasoning, content, calls) == ("I need the time.", "", ["get_time"]) and reader.called == 1
    json.dumps(reasoning)
