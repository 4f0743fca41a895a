"""Structured output pieces without a server: the bitmask (against a dense -inf mask built from llguidance's
own per-token answers), padded-vocab columns, the grammar cache, the hermes tool parser and the qwen3
reasoning splitter fed token by token (the demo tokenizer's pieces), plan_chat's rules."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from engine import StructuredSpec
from engine.protocol import RequestError
from engine.structured import GrammarCompiler, GrammarMatchers, TokenBitmask, apply_bitmask, pack_bits
from server.chat_tools import ChatOptions, ChatOutput, plan_chat
from server.errors import ApiError
from server.reasoning import ReasoningSplitter, prompt_reasoning_state
from server.structured_protocol import NamedToolChoice, Tool
from server.tool_parser import HermesToolParser

DEMO = "demo/model"
VOCAB = 448  # the demo model's padded vocabulary; its tokenizer has 396 tokens
EOS = (393, 395)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DEMO)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, VOCAB, EOS)


def _allowed(compiler: GrammarCompiler, spec: StructuredSpec, prefix: str, tok) -> set[int]:
    """The oracle: token t is allowed iff the matcher accepts it after `prefix` (one token at a time)."""
    m = compiler.matcher(spec)
    assert m.consume_tokens(tok.encode(prefix))
    return {t for t in range(len(tok)) if m.validate_tokens([t]) == 1} | (set(EOS) if m.is_accepting() else set())


@pytest.mark.parametrize("prefix", ['', '{"name": "a', '{"name": "ab", "n": 1'])
def test_bitmask_equals_per_token_validation_and_masks_padding(compiler, tok, prefix) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    spec = StructuredSpec("json", json.dumps(schema))
    matchers = GrammarMatchers(compiler)
    matchers.add(7, spec)
    for t in tok.encode(prefix):
        matchers.accept(7, t)
    bm = matchers.fill([3, 7])  # row 0 has no grammar, row 1 does
    assert bm is not None and bm.rows == [1]
    logits = torch.randn(2, VOCAB)
    out = logits.clone()
    apply_bitmask(out, bm)
    assert torch.equal(out[0], logits[0])  # the row without a grammar is untouched
    allowed = {int(i) for i in torch.nonzero(out[1] > float("-inf")).flatten()}
    assert allowed == _allowed(compiler, spec, prefix, tok)
    assert all(t < len(tok) for t in allowed)  # the padded columns 396..447 are never allowed
    assert torch.equal(out[1][sorted(allowed)], logits[1][sorted(allowed)])


def test_pack_bits_round_trips_bit_31() -> None:
    allowed = torch.zeros(64, dtype=torch.bool)
    allowed[[0, 31, 32, 63]] = True
    words = pack_bits(allowed)
    logits = torch.zeros(1, 64)
    apply_bitmask(logits, TokenBitmask([0], words.unsqueeze(0)))
    assert torch.nonzero(logits[0] == 0).flatten().tolist() == [0, 31, 32, 63]


def test_compile_cache_counts_and_errors(tok) -> None:
    c = GrammarCompiler(tok, VOCAB, EOS)
    spec = StructuredSpec("regex", "[a-z]{3}")
    c.compile(spec)
    c.compile(spec)
    c.matcher(spec)  # the engine's own lookup is not a client-visible hit
    assert (c.num_compiles, c.num_cache_hits) == (1, 1) and c.compile_seconds > 0
    for bad, word in ((StructuredSpec("regex", "a("), "unclosed group"),
                      (StructuredSpec("json", '{"type": "foo"}'), "foo"),
                      (StructuredSpec("grammar", "start: missing_rule"), "missing_rule"),
                      (StructuredSpec("choice", "[]"), "non-empty")):
        with pytest.raises(RequestError, match=word):
            c.compile(bad)
    assert c.num_compiles == 1  # failures are not cached


def test_reasoning_start_after_waits_for_the_token(compiler, tok) -> None:
    m = GrammarMatchers(compiler)
    m.add(1, StructuredSpec("choice", json.dumps(["yes"]), start_after=100))
    assert m.fill([1]) is None  # free before token 100
    m.accept(1, 5)
    assert m.fill([1]) is None
    m.accept(1, 100)
    bm = m.fill([1])
    assert bm is not None and bm.rows == [0]


def _pieces(tok, text: str) -> list[str]:
    """text cut where the demo tokenizer cuts it: the deltas a token-by-token stream carries."""
    ids = tok.encode(text)
    return [tok.decode(ids[:i + 1])[len(tok.decode(ids[:i])):] for i in range(len(ids))]


@pytest.mark.parametrize(("state", "text", "reasoning", "content"), [
    ("maybe", "<think>\nplan a b</think>\n\nthe answer", "\nplan a b", "\n\nthe answer"),
    ("maybe", "no tags here < think", None, "no tags here < think"),
    ("open", "still thinking </thi", "still thinking </thi", ""),
    ("open", "x</think>y</think>z", "x", "y</think>z"),
    ("done", "<think>a</think>b", None, "<think>a</think>b"),
])
def test_reasoning_split_whole_and_token_by_token(tok, state, text, reasoning, content) -> None:
    assert ReasoningSplitter(state).split(text) == (reasoning, content)
    s = ReasoningSplitter(state)
    got_r, got_c = "", ""
    for piece in _pieces(tok, text):
        r, c = s.feed(piece)
        got_r, got_c = got_r + r, got_c + c
    r, c = s.finish()
    assert (got_r + r, got_c + c) == (reasoning or "", content)


def test_prompt_reasoning_state() -> None:
    assert prompt_reasoning_state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "done"
    assert prompt_reasoning_state("<|im_start|>assistant\n<think>\n") == "open"
    assert prompt_reasoning_state("<|im_start|>assistant\n") == "maybe"


CALLS = ('I will call.\n<tool_call>\n{"name": "get", "arguments": {"city": "Paris", "n": 2}}\n</tool_call>\n'
         '<tool_call>\n{"name": "put", "arguments": {}}\n</tool_call>')


def test_hermes_whole_and_streamed_agree(tok) -> None:
    content, calls = HermesToolParser().parse(CALLS)
    assert content == "I will call.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get", {"city": "Paris", "n": 2}), ("put", {})]
    p = HermesToolParser()
    streamed, deltas = "", []
    for piece in _pieces(tok, CALLS):
        c, d = p.feed(piece)
        streamed, deltas = streamed + c, deltas + d
    c, d = p.finish()
    assert streamed + c == "I will call.\n" and [x["index"] for x in deltas + d] == [0, 1]
    assert [x["function"] for x in deltas + d] == [x["function"] for x in calls]


@pytest.mark.parametrize("text", ["plain answer", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\n{\"na"])
def test_hermes_leaves_non_calls_as_content(text) -> None:
    assert HermesToolParser().parse(text) == (text, [])


def test_chat_output_reasoning_then_tool_call() -> None:
    out = ChatOutput("open", parse_tools=True)
    msg = out.message('why</think>\n\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert msg["reasoning_content"] == "why" and msg["content"] is None and out.called
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"a": 1}


def test_plan_chat_rules() -> None:
    tools = [Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})]
    off = ChatOptions()
    with pytest.raises(ApiError, match="enable-auto-tool-choice"):
        plan_chat(tools, None, None, None, None, off, False)  # default tool_choice "auto" needs the flags
    assert plan_chat(tools, "auto", None, None, None, ChatOptions(True, "hermes"), False).parse_tools
    none = plan_chat(tools, "none", None, None, None, off, False)
    assert none.tools and not none.parse_tools and none.spec is None
    named = plan_chat(tools, NamedToolChoice.model_validate({"type": "function", "function": {"name": "f"}}),
                      None, None, None, off, False)
    assert named.spec is not None and named.spec.kind == "grammar" and named.parse_tools
    with pytest.raises(ApiError, match="not in 'tools'"):
        plan_chat(tools, NamedToolChoice.model_validate({"type": "function", "function": {"name": "g"}}),
                  None, None, None, off, False)
    with pytest.raises(ApiError, match="needs 'tools'"):
        plan_chat(None, "required", None, None, None, off, False)


def test_parallel_fill_equals_one_by_one(compiler, tok) -> None:
    spec = StructuredSpec("json", json.dumps({"type": "array", "items": {"enum": ["ab", "cd"]}}))
    masks = []
    for parallel in (True, False):
        m = GrammarMatchers(compiler, parallel)
        for sid in range(6):
            m.add(sid, spec)
            for t in tok.encode('["ab", "cd"'[: 1 + 2 * sid]):
                m.accept(sid, t)
        bm = m.fill(list(range(6)))
        assert bm is not None and bm.rows == list(range(6))
        masks.append(bm.mask)
    assert torch.equal(masks[0], masks[1]) and len({tuple(r.tolist()) for r in masks[0]}) > 1
