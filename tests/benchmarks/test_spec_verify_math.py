"""The arithmetic of benchmarks/gpu/spec_verify.py: expected tokens of a verify step and the
acceptance at which it breaks even."""

import pytest

from benchmarks.gpu.spec_verify import break_even, expected_tokens


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1  # every draft rejected: the correction token only
    assert expected_tokens(1.0, 4) == 5  # all accepted, plus the bonus token
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("cost", [1.2, 1.6, 2.0])
def test_break_even_inverts_expected_tokens(k, cost):
    a = break_even(cost, k)
    if cost > k + 1:
        assert a is None
    else:
        assert expected_tokens(a, k) == pytest.approx(cost, rel=1e-3)
    assert break_even(0.9, k) == 0.0  # cheaper than a decode step: pays at any acceptance
    assert break_even(k + 1.5, k) is None  # costs more than it could ever yield
