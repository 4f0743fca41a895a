"""Incremental detokenization on a byte-level BPE tokenizer (built offline) and stop-string helpers."""

from __future__ import annotations

import random

import pytest

from engine.detokenizer import IncrementalDetokenizer, find_stop, stop_holdback
from tools.tokenizer import SPECIAL_TOKENS, build_byte_bpe_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello, world!",
    "Café, naïve, façade, jalapeño, über, smörgåsbord, Ångström, crème brûlée.",
    "你好，世界。今天天气很好，我们去公园散步吧。机器学习和大语言模型。",
    "日本語のテキストも少し。한국어 문장도 조금.",
    "Emoji: 😀 😃 🎉 🚀 👍🏽 ❤️ 🇫🇷 and math ∑ ∫ √ π ≈ ≠ ≤.",
    "def add(a, b):\n    return a + b\n\n# comment with tabs\tand spaces  ",
] * 3

# Strings with characters the corpus never saw (so they are split into single-byte tokens) as well as
# ones it did.
SAMPLES = [
    "Hello, world!",
    "crème brûlée for the naïve café owner",
    "你好，世界。机器学习",
    "龘靐齉 are rare CJK characters",
    "🦄🐉🧬 unseen emoji, 😀 seen emoji",
    "👩‍👩‍👧‍👦 family (ZWJ sequence) and 🇯🇵 flag",
    "mixed: aé你😀b\n\ttabs and  double  spaces",
    "Ωμέγα ελληνικά и русский текст",
    "",
]


@pytest.fixture(scope="module")
def tok():
    return build_byte_bpe_tokenizer(CORPUS, vocab_size=600)


def _stream(tok, ids: list[int], prompt: list[int] | None = None, skip: bool = True):
    detok = IncrementalDetokenizer(tok, prompt or [], skip_special_tokens=skip)
    deltas = [detok.add(t) for t in ids]
    return detok, deltas


def test_tokenizer_layout(tok) -> None:
    assert len(tok) <= 600
    n = len(tok)
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [n - 3, n - 2, n - 1]
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    messages = [{"role": "user", "content": "hi"}]
    chat = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    for s in SAMPLES:
        assert tok.decode(tok.encode(s)) == s


@pytest.mark.parametrize("text", SAMPLES)
def test_deltas_concatenate_to_decode(tok, text: str) -> None:
    ids = tok.encode(text)
    detok, deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert detok.text == text
    assert all("\ufffd" not in d for d in deltas)
    assert detok.flush() == ""
    assert detok.text == text


def test_split_character_is_emitted_whole(tok) -> None:
    ids = tok.encode("a🦄b")
    pieces = [tok.decode([i]) for i in ids]
    assert len(ids) >= 5 and "\ufffd" in "".join(pieces), "the unicorn must span several byte tokens"
    _, deltas = _stream(tok, ids)
    assert deltas[0] == "a" and deltas[-1] == "b"
    # the 4 bytes of U+1F984 arrive as several tokens: nothing until the last, then the whole char
    assert deltas[1:-2] == [""] * (len(ids) - 3)
    assert deltas[-2] == "🦄"


def test_prompt_context_does_not_leak(tok) -> None:
    prompt = tok.encode("<|im_start|>user\n你好 café 🦄<|im_end|>\n<|im_start|>assistant\n")
    for text in SAMPLES:
        ids = tok.encode(text)
        detok, deltas = _stream(tok, ids, prompt=prompt)
        assert "".join(deltas) == detok.text == text


def test_prompt_ending_inside_a_character(tok) -> None:
    ids = tok.encode("x🦄yz")
    cut = 2  # "x" plus the first bytes of the unicorn
    detok, _ = _stream(tok, ids[cut:], prompt=ids[:cut])
    detok.flush()
    assert detok.text == tok.decode(ids[cut:])  # begins with U+FFFD for the orphaned bytes, as decode does


def test_special_tokens(tok) -> None:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [*tok.encode("héllo"), im_end, *tok.encode(" 你好")]
    detok, _ = _stream(tok, ids, skip=True)
    assert detok.text == tok.decode(ids, skip_special_tokens=True) == "héllo 你好"
    detok, _ = _stream(tok, ids, skip=False)
    assert detok.text == tok.decode(ids, skip_special_tokens=False) == "héllo<|im_end|> 你好"
    # a special token in the middle of a split character
    uni = tok.encode("🦄")
    ids = [*uni[:2], im_end, *uni[2:]]
    detok, deltas = _stream(tok, ids, skip=True)
    assert detok.text == "🦄" and all("\ufffd" not in d for d in deltas)


def test_flush_emits_incomplete_tail(tok) -> None:
    ids = tok.encode("ok 🦄")[:-1]  # stream ends inside the unicorn
    detok, deltas = _stream(tok, ids)
    full = tok.decode(ids)
    assert full.startswith("ok") and full.endswith("\ufffd")
    # everything up to the first token that carries part of the unicorn (here " " may share it)
    first_partial = next(i for i, t in enumerate(ids) if "\ufffd" in tok.decode([t]))
    assert "".join(deltas) == tok.decode(ids[:first_partial])
    tail = detok.flush()
    assert tail.endswith("\ufffd") and "".join(deltas) + tail == full
    assert detok.text == full
    assert detok.flush() == ""


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_match_decode(tok, skip: bool) -> None:
    # Arbitrary ids, including invalid UTF-8 byte runs and special tokens: after flush the text must
    # equal a one-shot decode, and no delta may hold a U+FFFD that decode would not produce.
    rng = random.Random(0)
    vocab = len(tok)
    for _ in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        detok, deltas = _stream(tok, ids, prompt=[rng.randrange(vocab) for _ in range(3)], skip=skip)
        detok.flush()
        full = tok.decode(ids, skip_special_tokens=skip)
        assert detok.text == full, ids
        if "\ufffd" not in full:
            assert all("\ufffd" not in d for d in deltas)


# ---- stop strings ---------------------------------------------------------------------------------


def test_find_stop() -> None:
    assert find_stop("hello STOP there", ["STOP"], 0) == 6
    assert find_stop("hello there", ["there", "lo"], 0) == 3  # the earliest of several
    assert find_stop("hello", [], 0) is None
    assert find_stop("hello", ["xyz"], 0) is None
    # new text "P" at index 6 completes a stop that began 3 characters earlier
    assert find_stop("abcSTOP", ["STOP"], 6) == 3
    # a match wholly before the new text was already seen on an earlier call: not searched again
    assert find_stop("STOP and more", ["STOP"], 10) is None
    # the search window is set by the LONGEST stop string
    assert find_stop("xxab", ["ab", "longstop"], 4) == 2
    assert find_stop("ab" + "y" * 10, ["ab", "zz"], 10) is None


def test_stop_holdback() -> None:
    assert stop_holdback("hello ST", ["STOP"]) == 2
    assert stop_holdback("hello", ["STOP"]) == 0
    assert stop_holdback("xx<|im", ["<|im_end|>"]) == 4
    assert stop_holdback("aaa", ["aab"]) == 2
    assert stop_holdback("abc", ["c", "cd"]) == 1  # "c" alone is a full stop: find_stop's job
    assert stop_holdback("", ["x"]) == 0
    assert stop_holdback("abc", []) == 0
    assert stop_holdback("zab", ["abx", "bxx"]) == 2  # the longest candidate over all stops


def test_streaming_with_stops(tok) -> None:
    # What the engine does: emit text up to the stop, holding back a possible stop prefix.
    text = "Answer: 42 你好 ###END### trailing"
    stops = ["###END###", "never"]
    detok = IncrementalDetokenizer(tok, [])
    sent = 0
    streamed = ""
    for t in tok.encode(text):
        before = len(detok.text)
        detok.add(t)
        hit = find_stop(detok.text, stops, before)
        if hit is not None:
            streamed += detok.text[sent:hit]
            break
        safe = len(detok.text) - stop_holdback(detok.text, stops)
        streamed += detok.text[sent:safe]
        sent = max(sent, safe)
        assert "#" not in streamed
    assert streamed == "Answer: 42 你好 "


@pytest.mark.parametrize("text", SAMPLES)
def test_token_bytes_join_into_the_text(tok, text: str) -> None:
    # The logprobs' `bytes` per token (server/logprobs.py): a token holding part of a character has
    # only that part's bytes, and all of them together are exactly the text's UTF-8.
    from server.logprobs import TokenText

    ids = tok.encode(text)
    per_token = TokenText(tok)
    assert b"".join(bytes(per_token.bytes(i)) for i in ids) == text.encode("utf-8")
    if "🦄" in text:
        assert any(len(per_token.bytes(i)) < 4 and "\ufffd" in tok.decode([i]) for i in ids)
