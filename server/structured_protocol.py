"""Request fields for structured output and tools (pydantic, strict, unknown keys refused): OpenAI's
`response_format`, `tools`, `tool_choice` and messages that carry tool calls, and vLLM's
`structured_outputs` ({"json" | "regex" | "choice" | "grammar" | "json_object"}). `output_spec` turns a
request into the engine's StructuredSpec (docs/structured-output.md)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine import StructuredSpec


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class JsonSchemaFormat(_Strict):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # OpenAI's key; "schema" shadows a BaseModel name
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'response_format': 'json_schema' is required with type json_schema, and only with it")
        return self


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("'structured_outputs' needs exactly one of json, regex, choice, grammar, json_object")
        return self


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class _FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _FunctionName


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


ANY_OBJECT = json.dumps({"type": "object"})


def _schema_text(schema: dict[str, Any] | str | None, field: str) -> str:
    if schema is None:
        return ANY_OBJECT
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except ValueError as e:
            raise ValueError(f"'{field}' is not valid JSON: {e}") from e
        return schema
    return json.dumps(schema)


def output_spec(response_format: ResponseFormat | None, structured: StructuredOutputs | None) -> StructuredSpec | None:
    """The constraint a request's response_format / structured_outputs asks for (None: free text);
    ValueError (a 400) when both are given."""
    if response_format is not None and response_format.type != "text" and structured is not None:
        raise ValueError("give 'response_format' or 'structured_outputs', not both")
    if structured is not None:
        if structured.json_ is not None:
            return StructuredSpec("json", _schema_text(structured.json_, "structured_outputs.json"))
        if structured.regex is not None:
            return StructuredSpec("regex", structured.regex)
        if structured.choice is not None:
            return StructuredSpec("choice", json.dumps(structured.choice))
        if structured.grammar is not None:
            return StructuredSpec("grammar", structured.grammar)
        return StructuredSpec("json", ANY_OBJECT)
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredSpec("json", ANY_OBJECT)
    assert response_format.json_schema is not None
    return StructuredSpec("json", _schema_text(response_format.json_schema.schema_, "response_format.json_schema"))
