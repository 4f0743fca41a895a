"""Build a tiny byte-level BPE tokenizer offline (no hub access), shaped like Qwen's.

Tests and the demo model use it so that the whole serving path, detokenization included, runs
without downloading anything.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML, as Qwen's instruct models use it (without the tool-calling parts).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_byte_bpe_tokenizer(corpus: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``corpus``; the result has at most ``vocab_size`` ids.

    Layout (like Qwen): ids ``0..255`` are the 256 byte symbols, then the learned merges, then the
    three special tokens as the LAST ids, in the order ``<|endoftext|>``, ``<|im_start|>``,
    ``<|im_end|>`` (so ``<|endoftext|>`` is ``len(tokenizer) - 3``). A small corpus can run out of
    merges before ``vocab_size``; read the ids from the tokenizer, never assume them.

    ``eos_token`` and ``pad_token`` are ``<|endoftext|>``. A chat template (ChatML) ends each turn
    with ``<|im_end|>``, so a chat-serving engine must also stop on ``<|im_end|>`` (Qwen lists both
    ids as eos in its generation_config).

    Every string round-trips exactly (byte-level: any UTF-8 text is encodable), and the trainer is
    deterministic for a given corpus and vocab_size.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    # Added after training so they take the last ids (the trainer would put them first).
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
