"""OpenAI request bodies (pydantic v2, strict). Nothing is silently ignored: an unknown field is a 400
naming it, and a field OpenAI defines that we do not implement is accepted only at its neutral value
(null / 0 / empty), otherwise a 400 naming it. Responses are built as plain dicts in serving.py.

Limits that keep one request's cost bounded (docs/RELIABILITY.md): at most MAX_CHOICES engine requests
(prompts x n), MAX_STOP stop strings of at most MAX_STOP_CHARS characters (the stop check runs in the
step thread for every token), MAX_STOP_TOKEN_IDS stop token ids; strings must be valid Unicode (a lone
surrogate from a "\\ud800" escape cannot be tokenized or encoded as UTF-8). max_tokens, logprobs and
the prompt length are checked by the engine against max_model_len and max_logprobs."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from server.structured_protocol import NamedToolChoice, ResponseFormat, StructuredOutputs, Tool, ToolCall

MAX_CHOICES = 256
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


def _bad_unicode(v: Any) -> list[str | int] | None:
    """The path to the first string (or key) in v holding a lone surrogate, else None."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")  # C speed; only lone surrogates fail
        except UnicodeEncodeError:
            return []
        return None
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        if isinstance(k, str) and _bad_unicode(k) is not None:
            return [k]
        if isinstance(x, (str, dict, list)) and (sub := _bad_unicode(x)) is not None:
            return [k, *sub]
    return None


class _Strict(BaseModel):
    # strict: "5" is not an int, 1 is not a bool; extra="forbid": unknown fields are errors.
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if (where := _bad_unicode(data)) is not None:
            field = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in where).lstrip(".") or "body"
            field = field.encode("utf-8", "backslashreplace").decode("utf-8")  # a key may hold the surrogate
            raise ValueError(f"field '{field}' is not valid Unicode (lone surrogate)")
        return data


def _neutral(v: Any, info: ValidationInfo) -> Any:
    if v in (None, 0, 0.0, "", [], {}, "none", "auto", {"type": "text"}, "text") and not isinstance(v, bool):
        return v
    raise ValueError(f"'{info.field_name}' is not supported by this server")


def _stop(v: Any) -> Any:
    if not (v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))):
        raise ValueError("'stop' must be a string or a list of strings")
    stops = [v] if isinstance(v, str) else v or []
    if len(stops) > MAX_STOP:
        raise ValueError(f"'stop' has {len(stops)} strings; at most {MAX_STOP} are allowed")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ValueError(f"a stop string is longer than {MAX_STOP_CHARS} characters")
    return v


# OpenAPI hints (json_schema_extra: documented, not enforced by pydantic, so that the error messages
# stay those of the validators and of the engine): what the `Any` fields accept, and the ranges.
_STOP_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
    {"type": "array", "maxItems": MAX_STOP, "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}},
    {"type": "null"}]}
_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    _IDS,
    {"type": "array", "minItems": 1, "items": _IDS}]}
_CONTENT_SCHEMA = {"anyOf": [
    {"type": "string"}, {"type": "null"},
    {"type": "array", "items": {"type": "object", "required": ["type", "text"], "additionalProperties": False,
                                "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$"


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by completions and chat completions (plus vLLM's common extensions)."""

    model: str
    max_tokens: int | None = Field(None, json_schema_extra={"minimum": 1})
    # Bounds keep values the sampler cannot take (inf, seeds beyond int64) from reaching the step thread.
    temperature: float | None = Field(None, allow_inf_nan=False, json_schema_extra={"minimum": 0})
    top_p: float | None = Field(None, allow_inf_nan=False, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    top_k: int | None = Field(None, ge=-1, le=1 << 31)
    n: int = Field(1, ge=1, le=128)
    stop: Any = Field(None, json_schema_extra=_STOP_SCHEMA)
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 63) - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Sampling (docs/sampling.md; ranges are checked by the engine with vLLM's messages):
    min_p: float | None = Field(None, allow_inf_nan=False)  # keep tokens with p >= min_p * p_max, [0, 1]
    repetition_penalty: float | None = Field(None, allow_inf_nan=False)  # > 0, on prompt + output tokens
    presence_penalty: float | None = Field(None, allow_inf_nan=False)  # [-2, 2], once per output token seen
    frequency_penalty: float | None = Field(None, allow_inf_nan=False)  # [-2, 2], per output occurrence
    logit_bias: dict[str, float] | None = None  # {"token id": bias}, bias clamped to [-100, 100]
    min_tokens: int = Field(0, ge=0)  # no EOS / stop token / stop string before this many tokens
    ignore_eos: bool = False  # keep generating past EOS
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)  # token ids that end the output
    skip_special_tokens: bool = True  # leave special tokens out of the text
    include_stop_str_in_output: bool = False  # keep the matched stop string / stop token text
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:{id}" (vLLM), not by their text
    # Structured output (server/structured_protocol.py): OpenAI's response_format, vLLM's structured_outputs.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # Defined by OpenAI, not implemented here: only their neutral values pass.
    best_of: Any = None

    _check_stop = field_validator("stop", mode="before")(_stop)

    @field_validator("logit_bias", mode="after")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k, b in (v or {}).items():
            if re.fullmatch(r"-?[0-9]+", k) is None:
                raise ValueError(f"'logit_bias' keys must be token ids (integers as strings), got {k!r}")
            if b != b or b in (float("inf"), float("-inf")):
                raise ValueError(f"'logit_bias' value for token {k} must be a finite number")
        return v

    @field_validator("best_of", mode="before")
    @classmethod
    def _best_of(cls, v: Any) -> Any:
        if v is None or v == 1:
            return v
        raise ValueError("'best_of' is not supported by this server (use n)")

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("'stream_options' is only allowed when 'stream' is true")
        return self

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """(token id, bias) with the bias clamped to [-100, 100], as vLLM does."""
        return tuple((int(k), min(100.0, max(-100.0, b))) for k, b in (self.logit_bias or {}).items())


class CompletionRequest(_Sampling):
    prompt: Any = Field(json_schema_extra=_PROMPT_SCHEMA)
    max_tokens: int | None = Field(16, json_schema_extra={"minimum": 1})
    logprobs: int | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 20})
    echo: bool = False
    suffix: Any = None

    @field_validator("suffix", mode="before")
    @classmethod
    def _unsupported_suffix(cls, v: Any, info: ValidationInfo) -> Any:
        return _neutral(v, info)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, str) or _is_ids(v):
            return v
        if isinstance(v, list) and v and all(isinstance(p, str) for p in v):
            return v
        if isinstance(v, list) and v and all(_is_ids(p) for p in v):
            return v
        raise ValueError("'prompt' must be a string, a non-empty list of strings, a list of token ids or a "
                         "non-empty list of token-id lists")

    @model_validator(mode="after")
    def _choices(self) -> CompletionRequest:
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ValueError(f"{len(self.prompts())} prompts x n={self.n} is more than {MAX_CHOICES} completions "
                             "in one request; split it")
        return self

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or _is_ids(self.prompt):
            return [self.prompt]
        return list(self.prompt)


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = Field(None, json_schema_extra=_CONTENT_SCHEMA)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers
    reasoning_content: str | None = None  # assistant: its reasoning (the template decides whether to show it)

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list):
            for part in v:
                if not isinstance(part, dict) or part.get("type") != "text" or set(part) != {"type", "text"} \
                        or not isinstance(part["text"], str):
                    raise ValueError("message content parts must be {\"type\": \"text\", \"text\": ...}; "
                                     "images, audio and files are not supported")
            return v
        raise ValueError("message 'content' must be a string or a list of text parts")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(p["text"] for p in self.content)
        return self.content or ""


# apply_chat_template's own parameters: set through the request's fields, never through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "add_special_tokens"})


class ChatTemplateOptions(_Strict):
    """vLLM's chat-template fields, shared by chat completions and /tokenize."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # template variables, e.g. {"enable_thinking": false}
    tools: list[Tool] | None = None  # rendered by the template (server/chat_tools.py)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        bad = sorted(set(v or ()) & _RESERVED_TEMPLATE_KWARGS)
        if bad:
            raise ValueError(f"'chat_template_kwargs' may not set {', '.join(bad)} (use the request field of that "
                             "name where there is one)")
        return v

    @model_validator(mode="after")
    def _generation_prompt(self) -> ChatTemplateOptions:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("'continue_final_message' and 'add_generation_prompt' cannot both be true")
        return self


class ChatCompletionRequest(_Sampling, ChatTemplateOptions):
    messages: list[ChatMessage] = Field(min_length=1)
    echo: bool = False  # vLLM's: the reply starts with the last message's content when it has the reply's role
    max_completion_tokens: int | None = Field(None, json_schema_extra={"minimum": 1})
    logprobs: bool = False
    top_logprobs: int | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 20})
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: Any = None

    @field_validator("functions", "function_call", "audio", "modalities", "prediction", "reasoning_effort",
                     "web_search_options", "service_tier", "store", "metadata", mode="before")
    @classmethod
    def _unsupported_chat(cls, v: Any, info: ValidationInfo) -> Any:
        if info.field_name == "store" and v is False:
            return v
        return _neutral(v, info)

    @model_validator(mode="after")
    def _logprob_fields(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("'top_logprobs' requires 'logprobs': true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give 'max_completion_tokens' or 'max_tokens', not both")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class LoadLoRAAdapterRequest(_Strict):
    lora_name: str = Field(json_schema_extra={"pattern": ADAPTER_NAME_PATTERN})
    lora_path: str = Field(max_length=4096)  # PATH_MAX
    load_inplace: bool = False  # vLLM's: replace a loaded adapter of this name instead of a 400


class UnloadLoRAAdapterRequest(_Strict):
    lora_name: str = Field(json_schema_extra={"pattern": ADAPTER_NAME_PATTERN})


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(ChatTemplateOptions):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    return_token_strs: bool | None = False


def _tokenize_kind(v: Any) -> str:
    return "<chat>" if isinstance(v, dict) and "messages" in v else "<prompt>"


# vLLM's two /tokenize bodies: one with `messages` (rendered by the chat template), one with `prompt`.
# The tags are in angle brackets so that error messages can leave them out of field paths.
TokenizeRequest = Annotated[Annotated[TokenizeChatRequest, Tag("<chat>")]
                            | Annotated[TokenizeCompletionRequest, Tag("<prompt>")], Discriminator(_tokenize_kind)]


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(json_schema_extra={"items": {"type": "integer", "minimum": 0}})


def format_validation_errors(errors: list[dict[str, Any]]) -> str:
    """One readable line naming every offending field (FastAPI puts 'body' first in each loc)."""
    parts: list[str] = []
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body" and not str(x).startswith("<")]
        field = ".".join(loc)
        kind, msg = e.get("type", ""), str(e.get("msg", ""))
        if kind == "json_invalid":
            text = f"malformed JSON: {e.get('ctx', {}).get('error', msg)}"
        elif kind == "extra_forbidden":
            text = f"unsupported field '{field}'"
        elif kind == "missing":
            text = f"missing field '{field}'" if field else "missing request body (a JSON object)"
        elif kind == "value_error":
            text = msg.removeprefix("Value error, ")
        elif field:
            text = f"field '{field}': {msg}"
        else:
            text = f"request body: {msg}"
        if text not in parts:
            parts.append(text)
    return "; ".join(parts) or "invalid request"
