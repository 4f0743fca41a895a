"""kernels.registry: a fast candidate is served only when it matches the reference on the check problem;
one that raises or differs (really, or through the documented fault switch) is replaced by the next."""

from __future__ import annotations

import logging

import pytest
import torch

from kernels.registry import FAULT_ENV, choose, fault_for

TOL = (1e-4, 1e-4)
WANT = torch.arange(12, dtype=torch.float32).reshape(3, 4)


def _runner(results: dict[str, torch.Tensor | Exception], calls: list[str]):
    def run(name: str) -> torch.Tensor:
        calls.append(name)
        r = results[name]
        if isinstance(r, Exception):
            raise r
        return r

    return run


def test_first_matching_candidate_is_chosen_and_checked(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []
    c = choose("op", ["fast", "reference"], _runner({"fast": WANT + 1e-6, "reference": WANT}, calls), TOL)
    assert (c.chosen, c.checked, c.rejected) == ("fast", True, ())
    assert calls == ["fast", "reference"]


@pytest.mark.parametrize("bad", [WANT * 1.01, WANT[:2], WANT * float("nan"), RuntimeError("driver says no")],
                         ids=["wrong", "shape", "nan", "raises"])
def test_failing_candidate_falls_back_with_a_warning(bad: torch.Tensor | Exception,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []
    with caplog.at_level(logging.WARNING, logger="kernels.registry"):
        c = choose("op", ["fast", "second", "reference"],
                   _runner({"fast": bad, "second": WANT, "reference": WANT}, calls), TOL)
    assert c.chosen == "second" and c.checked and [n for n, _ in c.rejected] == ["fast"]
    assert "op implementation 'fast' failed its start-up check" in caplog.text


def test_reference_alone_is_not_checked_against_itself() -> None:
    calls: list[str] = []
    c = choose("op", ["reference"], _runner({"reference": WANT}, calls), TOL)
    assert (c.chosen, c.checked, calls) == ("reference", False, [])
    with pytest.raises(ValueError, match="must end with"):
        choose("op", ["fast"], _runner({}, calls), TOL)


@pytest.mark.parametrize("mode", ["wrong", "raise"])
def test_fault_switch_rejects_every_fast_candidate_of_its_op(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, f"other=raise,op={mode}")
    assert fault_for("op") == mode and fault_for("other") == "raise" and fault_for("third") is None
    c = choose("op", ["fast", "reference"], _runner({"fast": WANT, "reference": WANT}, []), TOL)
    assert c.chosen == "reference" and [n for n, _ in c.rejected] == ["fast"]
    assert ("fault injected" in c.rejected[0][1]) == (mode == "raise")
    monkeypatch.setenv(FAULT_ENV, "op=sometimes")
    with pytest.raises(ValueError, match="expected OP=wrong or OP=raise"):
        fault_for("op")
