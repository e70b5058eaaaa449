"""How a chat choice's text is read as it streams: the model's thinking (a ``<think>``
block, with ``[http] reasoning = "think"``) apart from its answer, and tool calls out of
the answer (kvasir/http/toolcalls.py).

A thinking model opens its block itself (Qwen3: ``<think>`` first in its output) or finds
it opened by the chat template (DeepSeek-R1's prompt ends with ``<think>``); either way
the text up to ``</think>`` is the reasoning and the rest, less the blank lines after the
tag, the answer. Text that could begin a tag is held back until it shows it does not.
"""

from __future__ import annotations

from typing import Literal

from kvasir.http.toolcalls import CallParser, Parsed, held

OPEN, CLOSE = "<think>", "</think>"


class Thinking:
    """Splits reasoning from the answer."""

    def __init__(self, opened: bool) -> None:
        self.state: Literal["start", "inside", "after"] = "inside" if opened else "start"
        self.pending = ""
        self.fresh = False  # just after the block: blank lines are not the answer yet

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) that can go out now."""
        self.pending += text
        reasoning = answer = ""
        if self.state == "start":
            lead = self.pending.lstrip()
            if not lead or (OPEN.startswith(lead) and lead != OPEN):
                return "", ""
            if lead.startswith(OPEN):
                self.state, self.pending = "inside", lead[len(OPEN) :]
            else:
                self.state = "after"
        if self.state == "inside":
            end = self.pending.find(CLOSE)
            if end < 0:
                keep = held(self.pending, CLOSE)
                reasoning, self.pending = (
                    self.pending[: len(self.pending) - keep],
                    self.pending[len(self.pending) - keep :],
                )
                return reasoning, ""
            reasoning, self.pending = self.pending[:end], self.pending[end + len(CLOSE) :]
            self.state, self.fresh = "after", True
        if self.fresh:  # the blank lines between the block and the answer
            self.pending = self.pending.lstrip("\n")
            self.fresh = not self.pending
        answer, self.pending = self.pending, ""
        return reasoning, answer

    def flush(self) -> tuple[str, str]:
        """The end: an unclosed block is all reasoning (max_tokens cut the thinking)."""
        rest, self.pending = self.pending, ""
        return (rest, "") if self.state == "inside" else ("", rest)


class Reader:
    """One choice's reader: thinking (when the plan splits it), then tool calls (when the
    request gives tools), each optional."""

    def __init__(self, thinking: Thinking | None, calls: CallParser | None) -> None:
        self.thinking = thinking
        self.calls = calls
        self.called = 0  # tool calls made

    @property
    def done(self) -> bool:
        """The choice has made the one call it may (parallel_tool_calls false)."""
        return self.calls is not None and self.calls.done

    def read(self, text: str, end: bool = False) -> Parsed:
        reasoning, answer = self.thinking.push(text) if self.thinking is not None else ("", text)
        if end and self.thinking is not None:
            more_reasoning, more_answer = self.thinking.flush()
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        said = Parsed(answer) if self.calls is None else self.calls.push(answer)
        if end and self.calls is not None:
            rest = self.calls.flush()
            said = Parsed(said.content + rest.content, said.calls + rest.calls)
        self.called += len(said.calls)
        said.reasoning = reasoning
        return said
