"""`--reasoning-parser qwen3`: the text inside `<think>...</think>` goes to `reasoning_content`, the rest to
`content`, whole or streamed delta by delta (a tag split across deltas is held back until it is whole).

Where the output starts is read from the rendered prompt: a prompt that ends with `</think>` (Qwen3's
`enable_thinking: false` writes an empty think block) leaves no reasoning to parse; one that ends with
`<think>` (Qwen3.5, Qwen3 thinking-2507) opens it, so the output starts inside; otherwise the output is
reasoning only if it begins with `<think>` itself (Qwen3 with thinking on)."""

from __future__ import annotations

from typing import Literal

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ReasoningState = Literal["done", "open", "maybe"]


def prompt_reasoning_state(prompt: str) -> ReasoningState:
    tail = prompt.rstrip()
    if tail.endswith(THINK_CLOSE):
        return "done"
    if tail.endswith(THINK_OPEN):
        return "open"
    return "maybe"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that is a proper beginning of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Splits output text into (reasoning, content) incrementally; feed every delta, then finish()."""

    def __init__(self, state: ReasoningState) -> None:
        self.mode: Literal["start", "reasoning", "content"] = {
            "done": "content", "open": "reasoning", "maybe": "start"}[state]
        self._held = ""
        self.entered = self.mode == "reasoning"
        """The output had a reasoning part (possibly empty)."""

    def feed(self, delta: str) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        reasoning = content = ""
        if self.mode == "start":
            lead = text.lstrip()
            if THINK_OPEN.startswith(lead):  # still could be the opening tag (or only whitespace so far)
                self._held = text
                return "", ""
            if lead.startswith(THINK_OPEN):
                self.mode, self.entered, text = "reasoning", True, lead[len(THINK_OPEN):]
            else:
                self.mode = "content"
        if self.mode == "reasoning":
            end = text.find(THINK_CLOSE)
            if end < 0:
                keep = _partial_suffix(text, THINK_CLOSE)
                self._held = text[len(text) - keep:] if keep else ""
                return text[: len(text) - keep], ""
            reasoning, text, self.mode = text[:end], text[end + len(THINK_CLOSE):], "content"
        content = text
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back: an unfinished tag is text of the part it was in."""
        held, self._held = self._held, ""
        return (held, "") if self.mode == "reasoning" else ("", held)

    def split(self, text: str) -> tuple[str | None, str]:
        """The whole output at once: (reasoning, or None when the output had no reasoning part; content)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return (r1 + r2 if self.entered else None), c1 + c2
