"""Pick the next token of every sequence in a batch: greedy, temperature, min-p, top-k, top-p, seeds, logprobs.

The logits it gets are already processed (engine/logits_processors.py: min_tokens, logit_bias, penalties);
logprobs are computed from the raw ones when given, as vLLM reports by default.

Torch only and device-agnostic: everything runs on the device of the logits it is given, and nothing waits
for the device: the sampled ids stay there (the next step can read them as its inputs) and travel to the host
in one copy that `StepFuture.result()` waits for, the one wait of a step. Index and parameter lists reach the
device through an `Uploader` (engine/staging.py), which never makes the host wait either.

Sampling uses the inverse CDF: one uniform number per row, looked up in the cumulative distribution.
A seeded row draws its uniform from its own generator, so its token depends only on its own logits,
params and generator state, never on which rows share the batch. Rows that truncate (min-p / top-k / top-p)
look the number up in sorted-by-probability order, other rows in vocabulary order; the choice
depends only on the row's own params, which keeps that independence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.device import Device
from engine.protocol import SamplingParams, TokenLogprob

# Temperatures below this are treated as greedy (as vLLM does): dividing by a smaller one can
# overflow float32 and turn the softmax into NaN.
MIN_TEMPERATURE = 1e-5
# Slack for the top-p test: the mass before a token is a float32 cumsum, so a set whose exact mass
# is p (e.g. 0.5 + 0.3 with top_p=0.8) may come out a few ulps short; without slack it would wrongly
# keep one more token.
_TOP_P_EPS = 1e-6


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    """One entry per row; None where the request asked for no logprobs."""


Upload = Callable[[Sequence[int] | Sequence[float], torch.dtype], torch.Tensor]
"""Host list -> device tensor (engine.staging.Uploader; a blocking torch.tensor(..., device=) by default)."""


@dataclass(frozen=True)
class DeviceSample:
    """A step's sampled ids on the device and, packed into one float64 tensor (ids are exact below 2**53), what
    the host reads of it: the ids, then the chosen and top-k logprobs of the rows that asked for logprobs."""

    tokens: torch.Tensor
    """[B] long, on the device (the next step's inputs under async scheduling)."""
    packed: torch.Tensor
    lp_rows: list[int]
    k: int
    """Top logprobs computed per row that asked (the largest request of the batch)."""
    wants: list[int]
    """Top logprobs each lp row asked for."""

    def parse(self, flat: list[float]) -> SamplerOutput:
        batch, rows, k = self.tokens.numel(), self.lp_rows, self.k
        token_list = [int(t) for t in flat[:batch]]
        out: list[TokenLogprob | None] = [None] * batch
        if not rows:
            return SamplerOutput(token_list, out)
        chosen = flat[batch:batch + len(rows)]
        at = batch + len(rows)
        width = len(rows) * k
        for j, i in enumerate(rows):
            n = self.wants[j]
            top_lp = flat[at + j * k: at + j * k + n]
            top_ids = [int(t) for t in flat[at + width + j * k: at + width + j * k + n]]
            out[i] = TokenLogprob(token_id=token_list[i], logprob=chosen[j], top=list(zip(top_ids, top_lp)))
        return SamplerOutput(token_list, out)


class StepFuture:
    """One launched step's sampled ids on their way to the host. The copy is queued behind the step's kernels
    into page-locked memory, so it reads `packed` before any later step runs (a decode graph's ids are its static
    output); `result()` waits for it (on the CPU there is nothing to wait for). `order`: the launch ran its rows
    permuted; result row j is launch row order[j]."""

    def __init__(self, sample: DeviceSample | None, device: Device, order: list[int] | None = None) -> None:
        self.sample, self.order = sample, order
        self._event: object | None = None
        self._result: SamplerOutput | None = None if sample is not None else SamplerOutput([], [])
        if sample is not None:
            if device.pins_memory:
                self._host = torch.empty(sample.packed.shape, dtype=sample.packed.dtype, pin_memory=True)
                self._host.copy_(sample.packed, non_blocking=True)
                self._event = device.new_event()
                self._event.record()  # type: ignore[attr-defined]
            else:  # a snapshot: packed may be a graph's static output, which the next replay overwrites
                self._host = sample.packed.clone()

    def result(self) -> SamplerOutput:
        if self._result is None:
            assert self.sample is not None
            if self._event is not None:
                self._event.synchronize()  # type: ignore[attr-defined]
            out = self.sample.parse(self._host.tolist())
            if self.order is not None:
                out = SamplerOutput([out.token_ids[j] for j in self.order], [out.logprobs[j] for j in self.order])
            self._result = out
        return self._result


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator for one seeded request; the engine keeps it for the request's whole life."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _blocking_upload(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
                     ) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


class Sampler:
    def __init__(self, upload: Upload | None = None) -> None:
        self.upload = upload

    def _to(self, values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.upload(values, dtype) if self.upload is not None else _blocking_upload(values, dtype, device)

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        raw: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Sample and read the result back (tests, offline use). raw: the unprocessed logits, for logprobs
        (default: `logits`)."""
        sample = self.sample(logits, params, generators, raw)
        return sample.parse(sample.packed.tolist())

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        raw: torch.Tensor | None = None,
    ) -> DeviceSample:
        """The batch's next tokens on the device, with no host wait (StepFuture reads them back)."""
        batch = logits.shape[0]
        if len(params) != batch or len(generators) != batch:
            raise ValueError(
                f"sampler got {batch} rows of logits, {len(params)} params and {len(generators)} generators"
            )
        logits = logits.float()
        device = logits.device

        tokens = torch.empty(batch, dtype=torch.long, device=device)
        greedy_rows = [i for i, p in enumerate(params) if p.temperature < MIN_TEMPERATURE]
        # Rows with top-k or top-p need the sorted distribution; the others sample in vocab order.
        trunc_rows: list[int] = []
        plain_rows: list[int] = []
        for i, p in enumerate(params):
            if p.temperature < MIN_TEMPERATURE:
                continue
            if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
                trunc_rows.append(i)
            else:
                plain_rows.append(i)

        index = lambda rows: self._to(rows, torch.long, device)
        if greedy_rows:
            idx = index(greedy_rows)
            # torch.argmax returns the first maximal index: ties go to the lowest id.
            tokens[idx] = logits.index_select(0, idx).argmax(dim=-1)
        if plain_rows:
            idx = index(plain_rows)
            temps = self._to([params[i].temperature for i in plain_rows], torch.float32, device)
            probs = torch.softmax(logits.index_select(0, idx) / temps.unsqueeze(1), dim=-1)
            u = self._uniforms([generators[i] for i in plain_rows], device)
            tokens[idx] = _inverse_cdf(probs, u)
        if trunc_rows:
            idx = index(trunc_rows)
            tokens[idx] = self._sample_truncated(
                logits.index_select(0, idx),
                [params[i] for i in trunc_rows],
                [generators[i] for i in trunc_rows],
            )

        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not lp_rows:
            return DeviceSample(tokens, tokens.double(), [], 0, [])
        return self._logprobs(logits if raw is None else raw.float(), tokens, lp_rows, params)

    def _sample_truncated(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        vocab = logits.shape[-1]
        device = logits.device
        temps = self._to([p.temperature for p in params], torch.float32, device)
        # One stable sort for the whole group: ties keep vocab order, so a row's order is its own.
        scaled = logits / temps.unsqueeze(1)
        sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
        positions = torch.arange(vocab, device=device).unsqueeze(0)

        top_k = self._to([p.top_k if p.top_k > 0 else vocab for p in params], torch.long, device).clamp(max=vocab)
        drop = positions >= top_k.unsqueeze(1)
        if any(p.min_p > 0.0 for p in params):
            # min-p on the full tempered distribution (before top-k, as vLLM); the top token always stays.
            min_p = self._to([p.min_p for p in params], torch.float32, device)
            full = torch.softmax(sorted_logits, dim=-1)
            drop |= full < min_p.unsqueeze(1) * full[:, :1]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)  # renormalised over the top-k

        top_p = self._to([p.top_p for p in params], torch.float32, device)
        # Drop a token when the mass strictly before it already reaches top_p; the top token (mass
        # before = 0) always stays. Rows with top_p == 1 get a threshold nothing can reach.
        threshold = torch.where(top_p < 1.0, top_p - _TOP_P_EPS, torch.full_like(top_p, 2.0))
        mass_before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(mass_before >= threshold.unsqueeze(1), 0.0)

        u = self._uniforms(generators, device)
        pick = _inverse_cdf(probs, u)
        return sorted_ids.gather(1, pick.unsqueeze(1)).squeeze(1)

    def _uniforms(self, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
        """One U[0, 1) per row: seeded rows from their own generator, the rest in one global-RNG call."""
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if len(unseeded) == len(generators):
            return torch.rand(len(generators), device=device)
        u = torch.empty(len(generators), dtype=torch.float32, device=device)
        if unseeded:
            u[self._to(unseeded, torch.long, device)] = torch.rand(len(unseeded), device=device)
        for i, g in enumerate(generators):
            if g is not None:
                u[i:i + 1] = torch.rand(1, generator=g, device=device)
        return u

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, lp_rows: list[int], params: list[SamplingParams]
                  ) -> DeviceSample:
        """Logprobs from the raw model distribution (unscaled logits), as vLLM reports by default."""
        idx = self._to(lp_rows, torch.long, logits.device)
        raw = torch.log_softmax(logits.index_select(0, idx), dim=-1)
        chosen = raw.gather(1, tokens.index_select(0, idx).unsqueeze(1)).squeeze(1)
        wants = [params[i].logprobs or 0 for i in lp_rows]
        k = min(max(wants), raw.shape[-1])
        parts = [tokens.double(), chosen.double()]
        if k > 0:
            top_lp, top_ids = torch.topk(raw, k=k, dim=-1, sorted=True)
            parts += [top_lp.double().flatten(), top_ids.double().flatten()]
        return DeviceSample(tokens, torch.cat(parts), lp_rows, k, [min(n, k) for n in wants])


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

