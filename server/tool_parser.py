"""Qwen's tool-call format (what vLLM's `hermes` parser reads): each call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, written after any plain content.

HermesToolParser turns output text into OpenAI `tool_calls`, whole or streamed: content is passed on until
`<tool_call>` (a tag split across deltas is held back), then each call is sent as one delta when its
closing tag arrives (id, name and the complete arguments; clients concatenate argument deltas, so one
delta is a valid stream). A block that is not a JSON object with a string `name` is passed on as content,
unchanged, as is an unterminated one that does not parse.

tool_call_grammar writes the Lark grammar that forces this format for `tool_choice: "required"` or a
named function: the calls' JSON is constrained by each function's `parameters` schema (llguidance %json).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from engine import JSON_OPTIONS
from server.reasoning import _partial_suffix
from server.structured_protocol import Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool.function.name},
                                              "arguments": tool.function.parameters or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_grammar(tools: list[Tool], parallel: bool, tag_tokens: bool) -> str:
    """Lark: one call (or, when parallel, one or more separated by newlines) to one of `tools`. tag_tokens:
    the tokenizer has `<tool_call>` and `</tool_call>` as tokens (Qwen's): llguidance takes added tokens as
    special ones, which only a token reference (`<tool_call>` unquoted) matches, not their text."""
    schema: dict[str, Any] = (_call_schema(tools[0]) if len(tools) == 1
                              else {"anyOf": [_call_schema(t) for t in tools]})
    schema["x-guidance"] = JSON_OPTIONS
    more = ' ("\\n" call)*' if parallel else ""
    open_, close = (OPEN, CLOSE) if tag_tokens else (json.dumps(OPEN), json.dumps(CLOSE))
    return f'start: call{more}\ncall: {open_} "\\n" %json {json.dumps(schema)} "\\n" {close}\n'


def _parse_call(block: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call's JSON body, or None if it is not one."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], json.dumps(args, ensure_ascii=False)


class HermesToolParser:
    """Feed every content delta, then finish(); each returns (content delta, new tool-call deltas)."""

    def __init__(self) -> None:
        self._held = ""
        self._in_call = False
        self.calls: list[dict[str, Any]] = []
        """Every tool call found so far, in OpenAI's form."""

    def _call(self, name: str, args: str) -> dict[str, Any]:
        call = {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": args}}
        self.calls.append(call)
        return {"index": len(self.calls) - 1, **call}

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        text, self._held = self._held + delta, ""
        content: list[str] = []
        out: list[dict[str, Any]] = []

        def keep(piece: str) -> None:
            if piece.strip() or not self.calls:  # the newlines between and after calls are not content
                content.append(piece)

        while text:
            if self._in_call:
                end = text.find(CLOSE)
                if end < 0:
                    self._held = text
                    break
                parsed = _parse_call(text[:end])
                if parsed is None:
                    keep(OPEN + text[: end + len(CLOSE)])
                else:
                    out.append(self._call(*parsed))
                self._in_call, text = False, text[end + len(CLOSE):]
                continue
            start = text.find(OPEN)
            if start < 0:
                n = _partial_suffix(text, OPEN)
                self._held = text[len(text) - n:] if n else ""
                keep(text[: len(text) - n])
                break
            keep(text[:start])
            self._in_call, text = True, text[start + len(OPEN):]
        return "".join(content), out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        held, self._held = self._held, ""
        if not self._in_call:
            return ("" if self.calls and not held.strip() else held), []
        self._in_call = False
        parsed = _parse_call(held)
        if parsed is None:
            return OPEN + held, []
        return "", [self._call(*parsed)]

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The whole output at once: (content or None when there is none beside the calls, the calls)."""
        c1, _ = self.feed(text)
        c2, _ = self.finish()
        content = c1 + c2
        return (content if content.strip() or not self.calls else None), self.calls
