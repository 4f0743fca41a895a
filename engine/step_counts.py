"""Running totals over an engine's steps: what they held and what they cost (/metrics, benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.scheduler import SchedulerOutput


@dataclass
class StepCounts:
    """Running totals over the steps launched (counters: readers take differences)."""

    steps: int = 0
    tokens: int = 0
    """Tokens computed (prompt chunks plus one per decoding sequence)."""
    sequences: int = 0
    """Sequences in the steps (rows sampled or chunked)."""
    mixed: int = 0
    """Steps that hold a prompt chunk of more than one token (they cost more than a decode step)."""
    seconds: float = 0.0
    """Host time in core_step: scheduling, launch and the wait for the read-back."""

    def count(self, step: SchedulerOutput) -> None:
        tokens = step.num_tokens
        self.steps += 1
        self.tokens += tokens
        self.sequences += len(step.seqs)
        self.mixed += tokens > len(step.seqs)
