"""Sampling processors against transformers' logits processors on random logits, with different params on
every row of one batch: min_tokens, logit_bias, repetition / presence / frequency penalties (the last two
against OpenAI's formula), and min-p / top-k / top-p / temperature through the sampler (seeded draws must
land where the oracle's distribution puts them)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.logits_processors import LogitsProcessors
from engine.protocol import RequestError, SamplingParams
from engine.sampler import Sampler, make_generator
from engine.scheduler import ScheduledSeq
from tests.oracle import inverse_cdf_pick, sampling_probs, sampling_processed

CPU = torch.device("cpu")
VOCAB = 300
EOS = (7, 11)


def _random_params(rng: random.Random, i: int) -> SamplingParams:
    """Row i of a mixed batch: every processor on some rows, none on others."""
    kind = i % 5
    if kind == 0:
        return SamplingParams(temperature=0.0)
    bias = tuple((rng.randrange(VOCAB), rng.uniform(-100, 100)) for _ in range(rng.randrange(1, 6)))
    return SamplingParams(
        max_tokens=64, temperature=0.0,
        repetition_penalty=rng.choice([1.0, 0.5, 1.3, 2.0]) if kind != 1 else 1.0,
        presence_penalty=rng.uniform(-2, 2) if kind in (2, 4) else 0.0,
        frequency_penalty=rng.uniform(-2, 2) if kind in (3, 4) else 0.0,
        logit_bias=dict(bias) and tuple(dict(bias).items()) if kind in (1, 4) else (),
        min_tokens=rng.choice([0, 3, 40]), ignore_eos=rng.random() < 0.3,
        stop_token_ids=tuple(rng.sample(range(VOCAB), 2)) if rng.random() < 0.5 else ())


def _feed(proc: LogitsProcessors, seq_id: int, params: SamplingParams, prompt: list[int], out: list[int],
          chunk: int) -> ScheduledSeq:
    """Feed a sequence the way the scheduler does (prompt in chunks, then one output token per step);
    returns the entry of the step that samples after the last token."""
    tokens = prompt + out
    pos, entry = 0, None
    while pos < len(tokens):
        n = chunk if pos < len(prompt) else 1
        n = min(n, len(prompt) - pos) if pos < len(prompt) else 1
        entry = ScheduledSeq(seq_id, tokens[pos:pos + n], pos, [], pos + n == len(tokens), params,
                             num_prompt_tokens=len(prompt))
        proc.observe([entry])
        pos += n
    assert entry is not None
    return entry


def test_processors_match_transformers_on_a_mixed_batch() -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    proc = LogitsProcessors(VOCAB, CPU, EOS)
    rows = 25
    params = [_random_params(rng, i) for i in range(rows)]
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(rows)]
    outs = [[rng.randrange(20) for _ in range(rng.randrange(0, 12))] for _ in range(rows)]  # repeats
    entries = [_feed(proc, 100 + i, params[i], prompts[i], outs[i], chunk=rng.randrange(1, 9)) for i in range(rows)]
    logits = torch.randn(rows, VOCAB) * 4
    got = proc.apply(logits, entries)
    assert not torch.equal(got, logits)
    for i in range(rows):
        want = sampling_processed(logits[i], params[i], prompts[i], outs[i], EOS)
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-5, msg=f"row {i}: {params[i]}")
        if not params[i].uses_processors:
            assert torch.equal(got[i], logits[i])
    # Greedy on the processed logits is the oracle's argmax (ties excluded by the random logits).
    out = Sampler()(got, params, [None] * rows, raw=logits)
    assert out.token_ids == [int(sampling_processed(logits[i], params[i], prompts[i], outs[i], EOS).argmax())
                             for i in range(rows)]


def test_no_processor_is_the_identity_fast_path() -> None:
    proc = LogitsProcessors(VOCAB, CPU, EOS)
    p = SamplingParams(temperature=0.7, top_k=5, min_p=0.1)
    e = _feed(proc, 1, p, [1, 2, 3], [4], chunk=2)
    logits = torch.randn(1, VOCAB)
    assert proc.apply(logits, [e]) is logits
    assert proc.output_counts.shape[0] == 0  # no history kept for requests without penalties


def test_recompute_and_row_reuse_start_from_zero() -> None:
    proc = LogitsProcessors(VOCAB, CPU, EOS)
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5)
    prompt, out = [5, 6, 7], [8, 8, 9]
    _feed(proc, 1, p, prompt, out, chunk=2)
    again = _feed(proc, 1, p, prompt, out, chunk=4)  # preempted: recomputed from position 0
    row = proc._rows[1]
    assert proc.output_counts[row, 8] == 2 and proc.output_counts[row, 9] == 1
    assert proc.output_counts[row].sum() == 3 and proc.prompt_seen[row].sum() == 3
    proc.release([1])
    other = _feed(proc, 2, p, [1], [2], chunk=1)  # takes the freed row
    assert proc._rows[2] == row
    assert proc.output_counts[row].sum() == 1 and proc.prompt_seen[row].tolist().count(True) == 1
    del again, other


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_truncation_matches_transformers_warpers(seed: int) -> None:
    """Each seeded row's draw u picks, by inverse CDF over the oracle's distribution in descending-probability
    order (the sampler's documented order for truncating rows), the token the sampler returned."""
    rng = random.Random(seed)
    rows, steps = 24, 6
    params = [SamplingParams(temperature=rng.choice([0.5, 1.0, 1.7]), top_k=rng.choice([-1, 0, 1, 5, 50]),
                             top_p=rng.choice([1.0, 0.9, 0.5]), min_p=rng.choice([0.0, 0.05, 0.3]), seed=i)
              for i in range(rows)]
    params[0] = SamplingParams(temperature=1.0, min_p=0.2, seed=0)
    gens = [make_generator(p.seed or 0, CPU) for p in params]
    mirror = [make_generator(p.seed or 0, CPU) for p in params]
    sampler = Sampler()
    for step in range(steps):
        logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(100 * seed + step)) * 3
        got = sampler(logits, params, gens).token_ids
        for i, p in enumerate(params):
            dist = sampling_probs(logits[i], p)
            assert dist[got[i]] > 0, (i, p)
            want = inverse_cdf_pick(dist, p, float(torch.rand(1, generator=mirror[i])[0]))
            assert got[i] == want, (step, i, p)


def test_min_p_keeps_exactly_the_oracle_support() -> None:
    logits = torch.randn(1, VOCAB) * 2
    p = SamplingParams(temperature=1.0, min_p=0.1, seed=3)
    support = set(torch.nonzero(sampling_probs(logits[0], p)).flatten().tolist())
    gen = make_generator(3, CPU)
    seen = {Sampler()(logits, [p], [gen]).token_ids[0] for _ in range(400)}
    assert seen <= support and len(seen) >= min(len(support), 2)


@pytest.mark.parametrize(("kw", "field"), [
    (dict(min_p=1.5), "min_p must be in [0, 1]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=-3.0), "frequency_penalty must be in [-2, 2]"),
    (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens must be less than or equal to max_tokens=10"),
    (dict(logit_bias=((5, 101.0),)), "logit_bias value for token 5 must be in [-100, 100]"),
    (dict(logit_bias=((VOCAB, 1.0),)), "logit_bias has out-of-vocabulary token id(s) [300]"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids has out-of-vocabulary token id(s) [-1]"),
    (dict(top_k=-2), "top_k must be -1, 0 or a positive integer"),
])
def test_validation_names_the_field(kw: dict, field: str) -> None:
    with pytest.raises(RequestError) as e:
        SamplingParams(**kw).validate(vocab_size=VOCAB)
    assert field in str(e.value)
