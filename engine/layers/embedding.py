"""Vocab-parallel embedding and lm_head. The vocab is padded to a multiple of 64 x tp so it splits
evenly; the pad rows are zero and the pad logits are cut off after the gather."""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed import all_gather, all_reduce, tp_rank, tp_size

PAD_MULTIPLE = 64


def padded_vocab(vocab: int, tp: int) -> int:
    m = PAD_MULTIPLE * tp
    return (vocab + m - 1) // m * m


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.vocab, self.tp_rank, self.tp_size = vocab, tp_rank(), tp_size()
        self.padded = padded_vocab(vocab, self.tp_size)
        self.per_rank = self.padded // self.tp_size
        self.start = self.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if loaded.dim() != 2 or loaded.shape != (self.vocab, param.size(1)):
            raise ValueError(f"embedding: checkpoint shape {tuple(loaded.shape)}, "
                             f"expected ({self.vocab}, {param.size(1)})")
        end = min(self.start + self.per_rank, self.vocab)
        param.data.zero_()
        if end > self.start:
            param.data[: end - self.start].copy_(loaded[self.start:end])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local < 0) | (local >= self.per_rank)
        y = nn.functional.embedding(local.masked_fill(mask, 0), self.weight)
        y = y.masked_fill(mask.unsqueeze(-1), 0)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h @ W^T over this rank's vocab shard, gathered, pad columns removed."""

    def __init__(self, vocab: int, dim: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(vocab, dim, dtype)

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(h, self.weight)
        logits = all_gather(logits, dim=-1)
        return logits[..., : self.vocab]
