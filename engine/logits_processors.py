"""Logits processors that need more than a row's own logits: min_tokens, logit_bias and the repetition /
presence / frequency penalties, per row inside mixed batches, in vLLM's order (min_tokens, logit_bias,
penalties; temperature, min-p, top-k and top-p follow in the sampler).

Token history for the penalties is kept on the device, incrementally: a pool with one row per running
sequence that uses a penalty, holding a prompt-presence mask [V] (bool) and output-token counts [V]
(int32). Each step adds the tokens it feeds the model for those sequences (a prompt chunk, a prefix
recomputed after preemption, or the last sampled token) with one index_put_(accumulate): the host work is
proportional to the step's tokens, never to the vocabulary or to a sequence's length, and nothing is
re-uploaded per step. A sequence whose step starts at position 0 (new or recomputed) has its row zeroed
first. A step that samples a sequence has fed all its tokens, so at sampling time the row holds exactly
its prompt and output. Rows are freed with the scheduler's finished ids and reused; the pool doubles when
full (5 bytes x V per penalised sequence, nothing at all while no request uses a penalty).

logit_bias goes to the device once per sequence and is cached; min_tokens masks (EOS ids unless
ignore_eos, plus stop_token_ids) of the rows below their minimum with one index_put_. Only rank 0
samples, so only rank 0 keeps this state; nothing here runs inside a captured graph. A structured-output
bitmask (engine/structured.py) is applied last, to the rows that have a grammar.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from engine.sampler import Upload
from engine.scheduler import ScheduledSeq
from engine.structured import TokenBitmask, apply_bitmask


def output_len(s: ScheduledSeq) -> int:
    """Output tokens the sequence has once this step's tokens are fed (= before its next token)."""
    return max(s.start_pos + len(s.token_ids) - s.num_prompt_tokens, 0)


class LogitsProcessors:
    def __init__(self, vocab: int, device: torch.device, eos_ids: Iterable[int], upload: Upload | None = None) -> None:
        """upload: host lists -> device without a host wait (engine.staging.Uploader); default a blocking copy."""
        self.vocab, self.device = vocab, device
        self.upload: Upload = upload or (lambda values, dtype: torch.tensor(values, dtype=dtype, device=device))
        self.eos_ids = tuple(sorted(eos_ids))
        self._rows: dict[int, int] = {}  # seq_id -> history row
        self._free: list[int] = []
        self.prompt_seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self._bias: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # seq_id -> (ids, values)

    def release(self, seq_ids: Iterable[int]) -> None:
        for sid in seq_ids:
            self._bias.pop(sid, None)
            row = self._rows.pop(sid, None)
            if row is not None:
                self._free.append(row)

    def _alloc(self, seq_id: int) -> int:
        if not self._free:
            cap = self.output_counts.shape[0]
            new = max(4, 2 * cap)
            self.prompt_seen = torch.cat([self.prompt_seen, self.prompt_seen.new_zeros(new - cap, self.vocab)])
            self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(new - cap, self.vocab)])
            self._free.extend(range(new - 1, cap - 1, -1))
        row = self._rows[seq_id] = self._free.pop()
        return row

    def observe(self, seqs: Sequence[ScheduledSeq]) -> None:
        """Record the tokens this step feeds for the sequences that use a penalty (call every step)."""
        if not any(s.params.uses_history for s in seqs):
            return
        fresh: list[int] = []
        p_rows: list[int] = []
        p_ids: list[int] = []
        o_rows: list[int] = []
        o_ids: list[int] = []
        for s in seqs:
            if not s.params.uses_history:
                continue
            row = self._rows.get(s.seq_id)
            if row is None or s.start_pos == 0:
                fresh.append(self._alloc(s.seq_id) if row is None else row)
                row = fresh[-1]
            k = min(max(s.num_prompt_tokens - s.start_pos, 0), len(s.token_ids))
            p_rows += [row] * k
            p_ids += s.token_ids[:k]
            o_rows += [row] * (len(s.token_ids) - k)
            o_ids += s.token_ids[k:]
        dev, up = self.device, self.upload
        if fresh:
            idx = up(fresh, torch.long)
            self.prompt_seen.index_fill_(0, idx, False)
            self.output_counts.index_fill_(0, idx, 0)
        if p_ids:
            where = (up(p_rows, torch.long), up(p_ids, torch.long))
            self.prompt_seen.index_put_(where, torch.ones((), dtype=torch.bool, device=dev))
        if o_ids:
            where = (up(o_rows, torch.long), up(o_ids, torch.long))
            self.output_counts.index_put_(where, torch.ones(len(o_ids), dtype=torch.int32, device=dev),
                                          accumulate=True)

    def apply(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq], bitmask: TokenBitmask | None = None
              ) -> torch.Tensor:
        """The processed float32 logits of the sampled rows (row i is seqs[i]); `logits` is left as is.
        bitmask: the grammar rows' allowed tokens (engine/structured.py), applied last (-inf stays -inf
        through the penalties and the bias, so the order does not matter). Returns `logits` itself when no
        row uses a processor or a grammar (the fast path does no work)."""
        if bitmask is None and not any(s.params.uses_processors for s in seqs):
            return logits
        out = logits.clone()
        dev = out.device
        m_rows: list[int] = []
        m_ids: list[int] = []
        b_rows: list[int] = []
        b_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        h_batch: list[int] = []
        for i, s in enumerate(seqs):
            p = s.params
            if p.min_tokens and output_len(s) < p.min_tokens:
                ids = (*(() if p.ignore_eos else self.eos_ids), *p.stop_token_ids)
                m_rows += [i] * len(ids)
                m_ids += ids
            if p.logit_bias:
                b_rows.append(i)
                b_parts.append(self._bias_of(s))
            if p.uses_history:
                h_batch.append(i)
        up = self.upload
        if m_ids:
            where = (up(m_rows, torch.long), up(m_ids, torch.long))
            out.index_put_(where, torch.full((), float("-inf"), device=dev))
        if b_parts:
            sizes = [len(ids) for ids, _ in b_parts]
            rows = torch.repeat_interleave(up(b_rows, torch.long), up(sizes, torch.long), output_size=sum(sizes))
            ids = torch.cat([ids for ids, _ in b_parts])
            out.index_put_((rows, ids), torch.cat([v for _, v in b_parts]), accumulate=True)
        if h_batch:
            self._penalize(out, h_batch, [seqs[i] for i in h_batch])
        if bitmask is not None:
            apply_bitmask(out, bitmask)
        return out

    def _bias_of(self, s: ScheduledSeq) -> tuple[torch.Tensor, torch.Tensor]:
        got = self._bias.get(s.seq_id)
        if got is None:
            ids = self.upload([t for t, _ in s.params.logit_bias], torch.long)
            vals = self.upload([b for _, b in s.params.logit_bias], torch.float32)
            got = self._bias[s.seq_id] = (ids, vals)
        return got

    def _penalize(self, out: torch.Tensor, batch_rows: list[int], seqs: list[ScheduledSeq]) -> None:
        b = self.upload(batch_rows, torch.long)
        pool = self.upload([self._rows[s.seq_id] for s in seqs], torch.long)

        def col(values: list[float]) -> torch.Tensor:
            return self.upload(values, torch.float32).unsqueeze(1)

        rep = col([s.params.repetition_penalty for s in seqs])
        freq = col([s.params.frequency_penalty for s in seqs])
        pres = col([s.params.presence_penalty for s in seqs])
        counts = self.output_counts.index_select(0, pool)
        in_output = counts > 0
        seen = in_output | self.prompt_seen.index_select(0, pool)
        x = out.index_select(0, b)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts - pres * in_output
        out.index_copy_(0, b, x)
