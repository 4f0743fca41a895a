"""Chat requests with tools, tool_choice, response_format and a reasoning parser: what to render, what to
constrain and how to split the reply (vLLM's rules and messages where it has them).

- `tools` go to the chat template. `tool_choice` (default "auto" when tools are given): "none" renders
  them and parses nothing; "auto" parses `<tool_call>` blocks and needs `--enable-auto-tool-choice
  --tool-call-parser hermes`, as in vLLM; "required" and a named function force the format with a
  grammar (so they need no flag) and are parsed the same way.
- With `--reasoning-parser qwen3` the `<think>` part goes to `reasoning_content` and a grammar applies
  only after `</think>` (the reasoning itself stays free), unless the prompt already closed it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from engine import StructuredSpec
from server.errors import ApiError
from server.reasoning import THINK_CLOSE, ReasoningSplitter, ReasoningState
from server.structured_protocol import NamedToolChoice, ResponseFormat, StructuredOutputs, Tool, output_spec
from server.tool_parser import HermesToolParser, tool_call_grammar

if TYPE_CHECKING:
    from server.openai_protocol import ChatMessage


@dataclass(frozen=True)
class ChatOptions:
    """Server flags for chat replies."""

    enable_auto_tool_choice: bool = False
    """--enable-auto-tool-choice: the model decides when to call a tool (tool_choice "auto")."""
    tool_call_parser: Literal["hermes"] | None = None
    """--tool-call-parser: how tool calls are written in the output."""
    reasoning_parser: Literal["qwen3"] | None = None
    """--reasoning-parser: split `<think>...</think>` into reasoning_content."""


@dataclass(frozen=True)
class ChatPlan:
    tools: list[dict[str, Any]] | None
    """For the chat template."""
    parse_tools: bool
    spec: StructuredSpec | None


def plan_chat(tools: list[Tool] | None, tool_choice: str | NamedToolChoice | None, parallel: bool | None,
              response_format: ResponseFormat | None, structured: StructuredOutputs | None,
              opts: ChatOptions, tag_tokens: bool) -> ChatPlan:
    """tag_tokens: the tokenizer has <tool_call> / </tool_call> tokens (see tool_call_grammar)."""
    try:
        spec = output_spec(response_format, structured)
    except ValueError as e:
        raise ApiError(400, str(e)) from e
    if not tools:
        if tool_choice not in (None, "none"):
            raise ApiError(400, "'tool_choice' needs 'tools'")
        return ChatPlan(None, False, spec)
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ChatPlan(rendered, False, spec)
    if choice == "auto":
        if not (opts.enable_auto_tool_choice and opts.tool_call_parser):
            raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
                           "be set")
        return ChatPlan(rendered, True, spec)
    if spec is not None:
        raise ApiError(400, "a 'required' or named 'tool_choice' cannot be combined with 'response_format' or "
                       "'structured_outputs'")
    if choice == "required":
        grammar = tool_call_grammar(tools, parallel is not False, tag_tokens)
        return ChatPlan(rendered, True, StructuredSpec("grammar", grammar))
    assert isinstance(choice, NamedToolChoice)
    named = [t for t in tools if t.function.name == choice.function.name]
    if not named:
        raise ApiError(400, f"tool_choice names function {choice.function.name!r}, which is not in 'tools'")
    return ChatPlan(rendered, True, StructuredSpec("grammar", tool_call_grammar(named, False, tag_tokens)))


def reasoning_spec(spec: StructuredSpec | None, state: ReasoningState | None, think_close: int | None
                   ) -> StructuredSpec | None:
    """With reasoning still to come, the grammar waits for `</think>`."""
    if spec is None or state in (None, "done"):
        return spec
    assert think_close is not None
    return replace(spec, start_after=think_close)


def think_close_id(vocab: dict[str, int]) -> int:
    """The `</think>` token (the qwen3 parser needs it to be one token, as vLLM's does)."""
    if THINK_CLOSE not in vocab:
        raise ValueError(f"--reasoning-parser qwen3: the tokenizer has no {THINK_CLOSE} token")
    return vocab[THINK_CLOSE]


def _arguments(text: str) -> Any:
    """A call's arguments as templates read them: the JSON object (vLLM's conversion), else the text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def template_message(m: ChatMessage) -> dict[str, Any]:
    """One request message as the chat template gets it (developer is system)."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    return out


class ChatOutput:
    """One choice's reply split into reasoning_content, content and tool_calls, streamed or whole."""

    def __init__(self, reasoning: ReasoningState | None, parse_tools: bool) -> None:
        self.reasoning = ReasoningSplitter(reasoning) if reasoning is not None else None
        self.tools = HermesToolParser() if parse_tools else None

    def _split(self, reasoning: str, content: str, final: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if final:
                more, late = self.tools.finish()
                content, calls = content + more, calls + late
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The delta fields for this piece of text (final: the last one, which flushes what was held)."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        if final and self.reasoning is not None:
            r2, c2 = self.reasoning.finish()
            reasoning, content = reasoning + r2, content + c2
        return self._split(reasoning, content, final)

    def message(self, text: str) -> dict[str, Any]:
        """The whole reply's message fields (content None when there is only reasoning and/or tool calls)."""
        reasoning: str | None = None
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text)
        msg: dict[str, Any] = {"content": content}
        if self.tools is not None:
            msg["content"], calls = self.tools.parse(content)
            msg["tool_calls"] = calls
        if self.reasoning is not None:
            msg["reasoning_content"] = reasoning
        return msg

    @property
    def called(self) -> bool:
        return self.tools is not None and bool(self.tools.calls)
