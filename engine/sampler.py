"""Pick the next token of every sequence in a batch: greedy, temperature, min-p, top-k, top-p, seeds, logprobs.

The logits it gets are already processed (engine/logits_processors.py: min_tokens, logit_bias, penalties);
logprobs are computed from the raw ones when given, as vLLM reports by default.

Torch only and device-agnostic: everything runs on the device of the logits it is given.

Sampling uses the inverse CDF: one uniform number per row, looked up in the cumulative distribution.
A seeded row draws its uniform from its own generator, so its token depends only on its own logits,
params and generator state, never on which rows share the batch. Rows that truncate (min-p / top-k / top-p)
look the number up in sorted-by-probability order, other rows in vocabulary order; the choice
depends only on the row's own params, which keeps that independence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.protocol import SamplingParams, TokenLogprob

# Temperatures below this are treated as greedy (as vLLM does): dividing by a smaller one can
# overflow float32 and turn the softmax into NaN.
_MIN_TEMPERATURE = 1e-5
# Slack for the top-p test: the mass before a token is a float32 cumsum, so a set whose exact mass
# is p (e.g. 0.5 + 0.3 with top_p=0.8) may come out a few ulps short; without slack it would wrongly
# keep one more token.
_TOP_P_EPS = 1e-6


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    """One entry per row; None where the request asked for no logprobs."""


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator for one seeded request; the engine keeps it for the request's whole life."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        raw: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """raw: the unprocessed logits, for logprobs (default: `logits`)."""
        batch = logits.shape[0]
        if len(params) != batch or len(generators) != batch:
            raise ValueError(
                f"sampler got {batch} rows of logits, {len(params)} params and {len(generators)} generators"
            )
        if batch == 0:
            return SamplerOutput(token_ids=[], logprobs=[])
        logits = logits.float()
        device = logits.device

        tokens = torch.empty(batch, dtype=torch.long, device=device)
        greedy_rows = [i for i, p in enumerate(params) if p.temperature < _MIN_TEMPERATURE]
        # Rows with top-k or top-p need the sorted distribution; the others sample in vocab order.
        trunc_rows: list[int] = []
        plain_rows: list[int] = []
        for i, p in enumerate(params):
            if p.temperature < _MIN_TEMPERATURE:
                continue
            if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
                trunc_rows.append(i)
            else:
                plain_rows.append(i)

        if greedy_rows:
            idx = _index(greedy_rows, device)
            # torch.argmax returns the first maximal index: ties go to the lowest id.
            tokens[idx] = logits.index_select(0, idx).argmax(dim=-1)
        if plain_rows:
            idx = _index(plain_rows, device)
            probs = _scaled_probs(logits.index_select(0, idx), [params[i] for i in plain_rows])
            u = _uniforms([generators[i] for i in plain_rows], device)
            tokens[idx] = _inverse_cdf(probs, u)
        if trunc_rows:
            idx = _index(trunc_rows, device)
            tokens[idx] = self._sample_truncated(
                logits.index_select(0, idx),
                [params[i] for i in trunc_rows],
                [generators[i] for i in trunc_rows],
            )

        logprobs: list[TokenLogprob | None] = [None] * batch
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        token_list: list[int]
        if lp_rows:
            token_list, logprobs = _logprobs(logits if raw is None else raw.float(), tokens, lp_rows, params, batch)
        else:
            token_list = tokens.tolist()
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)

    @staticmethod
    def _sample_truncated(
        logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        vocab = logits.shape[-1]
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        # One stable sort for the whole group: ties keep vocab order, so a row's order is its own.
        scaled = logits / temps.unsqueeze(1)
        sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
        positions = torch.arange(vocab, device=device).unsqueeze(0)

        top_k = torch.tensor(
            [p.top_k if p.top_k > 0 else vocab for p in params], dtype=torch.long, device=device
        ).clamp_(max=vocab)
        drop = positions >= top_k.unsqueeze(1)
        if any(p.min_p > 0.0 for p in params):
            # min-p on the full tempered distribution (before top-k, as vLLM); the top token always stays.
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
            full = torch.softmax(sorted_logits, dim=-1)
            drop |= full < min_p.unsqueeze(1) * full[:, :1]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)  # renormalised over the top-k

        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        # Drop a token when the mass strictly before it already reaches top_p; the top token (mass
        # before = 0) always stays. Rows with top_p == 1 get a threshold nothing can reach.
        threshold = torch.where(top_p < 1.0, top_p - _TOP_P_EPS, torch.full_like(top_p, 2.0))
        mass_before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(mass_before >= threshold.unsqueeze(1), 0.0)

        u = _uniforms(generators, device)
        pick = _inverse_cdf(probs, u)
        return sorted_ids.gather(1, pick.unsqueeze(1)).squeeze(1)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _scaled_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
    return torch.softmax(logits / temps.unsqueeze(1), dim=-1)


def _uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One U[0, 1) per row: seeded rows from their own generator, the rest in one global-RNG call."""
    u = torch.empty(len(generators), dtype=torch.float32, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        u[_index(unseeded, device)] = torch.rand(len(unseeded), device=device)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, generator=g, device=device)[0]
    return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first position whose cumulative mass exceeds u * total mass.

    The cdf only rises at tokens with probability > 0, so such a position always has mass; masked
    tokens can never be picked.
    """
    cdf = torch.cumsum(probs, dim=-1)  # monotone even in float: every term is >= 0
    total = cdf[:, -1:]
    pick = torch.searchsorted(cdf, (u.unsqueeze(1) * total).contiguous(), right=True)
    # Rounding can put u * total at the total itself (pick == vocab): take the last token with mass,
    # i.e. the first position where the cdf reaches the total.
    last = torch.searchsorted(cdf, total.contiguous(), right=False)
    return torch.where(pick >= probs.shape[-1], last, pick).squeeze(1)


def _logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    lp_rows: list[int],
    params: list[SamplingParams],
    batch: int,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Logprobs from the raw model distribution (unscaled logits), as vLLM reports by default."""
    device = logits.device
    idx = _index(lp_rows, device)
    raw = torch.log_softmax(logits.index_select(0, idx), dim=-1)
    chosen = raw.gather(1, tokens.index_select(0, idx).unsqueeze(1)).squeeze(1)
    k = min(max(params[i].logprobs or 0 for i in lp_rows), raw.shape[-1])
    # One device -> host copy for the whole step: ids (exact in float64), chosen and top-k logprobs together.
    parts = [tokens.double(), chosen.double()]
    if k > 0:
        top_lp, top_ids = torch.topk(raw, k=k, dim=-1, sorted=True)
        parts += [top_lp.double().flatten(), top_ids.double().flatten()]
    flat: list[float] = torch.cat(parts).tolist()
    token_list = [int(t) for t in flat[:batch]]
    chosen_l = flat[batch:batch + len(lp_rows)]
    at = batch + len(lp_rows)
    width = len(lp_rows) * k
    top_lp_l = [flat[at + j * k: at + (j + 1) * k] for j in range(len(lp_rows))]
    top_ids_l = [[int(t) for t in flat[at + width + j * k: at + width + (j + 1) * k]] for j in range(len(lp_rows))]
    out: list[TokenLogprob | None] = [None] * batch
    for j, i in enumerate(lp_rows):
        n = params[i].logprobs or 0
        top = list(zip(top_ids_l[j][:n], top_lp_l[j][:n]))
        out[i] = TokenLogprob(token_id=token_list[i], logprob=chosen_l[j], top=top)
    return token_list, out
