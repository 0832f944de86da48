"""linicl.stats: the intervals and significance guards every experiment table relies on."""

import numpy as np
import pytest

from linicl.errors import LiniclError
from linicl import stats as S
from linicl.stats import Interval, collapsed, gain, paired_bootstrap, recovered, wilson


def _correct(hits: int, n: int, start: int = 0) -> np.ndarray:
    """Per-query correctness with ``hits`` ones starting at query ``start`` (wrapping round)."""
    out = np.zeros(n, bool)
    out[(start + np.arange(hits)) % n] = True
    return out


# ------------------------------------------------------------------------------------------ wilson
@pytest.mark.parametrize("k, n, low, high", [(0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634),
                                             (10, 10, 0.7225, 1.0), (1, 100, 0.0018, 0.0545)])
def test_wilson_matches_known_values(k, n, low, high):
    iv = wilson(k, n)
    assert iv.value == pytest.approx(k / n)
    assert iv.low == pytest.approx(low, abs=1e-4) and iv.high == pytest.approx(high, abs=1e-4)


def test_wilson_stays_inside_the_unit_interval_and_contains_the_estimate():
    for n in (1, 2, 7, 50):
        for k in range(n + 1):
            lo, hi = wilson(k, n)[1:]
            assert 0.0 <= lo <= k / n <= hi <= 1.0
    assert wilson(0, 5).low == 0.0 and wilson(5, 5).high == 1.0  # exact ends, no 1e-17 rounding left


@pytest.mark.parametrize("k, n", [(-1, 10), (11, 10), (0, 0), (1, 2.5), (1, True)])
def test_wilson_rejects_impossible_counts(k, n):
    with pytest.raises(LiniclError, match="wilson"):
        wilson(k, n)


def test_interval_format_and_zero_test():
    assert Interval(0.5, 0.25, 0.75).fmt() == "50.0 [25.0, 75.0]"
    assert Interval(0.1, 0.01, 0.2).excludes_zero() and Interval(-0.2, -0.3, -0.1).excludes_zero()
    assert not Interval(0.0, -0.1, 0.1).excludes_zero()


# ------------------------------------------------------------------------------------------ paired
def test_paired_bootstrap_of_identical_methods_is_exactly_zero():
    a = _correct(13, 40)
    assert tuple(paired_bootstrap(a, a.copy())) == (0.0, 0.0, 0.0)


def test_paired_bootstrap_detects_a_clear_difference_and_is_deterministic():
    a, b = _correct(36, 40), _correct(8, 40)  # 90 % vs 20 %
    d = paired_bootstrap(a, b)
    assert d.value == pytest.approx(0.7) and d.low > 0.4 and d.high < 1.0 and d.excludes_zero()
    assert paired_bootstrap(a, b) == d and paired_bootstrap(b, a).high < 0


def test_paired_bootstrap_does_not_call_noise_a_difference():
    a, b = _correct(5, 10), _correct(5, 10, start=3)  # equal accuracy, different queries right
    assert not paired_bootstrap(a, b).excludes_zero()


def test_paired_statistics_need_arrays_of_one_length():
    with pytest.raises(LiniclError, match="one length"):
        paired_bootstrap([1, 0, 1], [1, 0])
    with pytest.raises(LiniclError, match="non-empty"):
        paired_bootstrap([], [])


# ------------------------------------------------------------------------------------------ gain
def test_recovered_is_none_without_a_significant_gain():
    zero, few = _correct(4, 16), _correct(5, 16)  # one more query right: no significant gain
    assert not gain(few, zero).excludes_zero()
    assert recovered(few, few, zero) is None


def test_recovered_is_none_when_the_prompt_significantly_hurts():
    zero, few = _correct(28, 32), _correct(4, 32)   # few-shot collapses: a significant loss
    assert gain(few, zero).high < 0
    assert recovered(few, few, zero) is None and recovered(_correct(16, 32), few, zero) is None


def test_recovered_is_one_for_the_few_shot_method_itself():
    zero, few = _correct(4, 32), _correct(28, 32)
    r = recovered(few, few, zero)
    assert r.value == pytest.approx(1.0) and r.low == pytest.approx(1.0) and r.high == pytest.approx(1.0)


def test_recovered_of_zero_shot_is_zero_and_of_a_partial_method_in_between():
    zero, few = _correct(4, 32), _correct(28, 32)
    assert recovered(zero, few, zero).value == pytest.approx(0.0)
    half = _correct(16, 32)  # half way between 4 and 28 queries right
    r = recovered(half, few, zero)
    assert r.value == pytest.approx(0.5) and r.low < 0.5 < r.high


def test_a_constant_predictor_is_not_reported_as_recovering_three_times_the_gain():
    """The issue's case: zero-shot 4/16, prompted 5/16, a constant predictor that happens to hit 7/16
    gold answers: (7 - 4) / (5 - 4) = 3.00 "recovered" from a gain that is noise."""
    zero, few = _correct(4, 16), _correct(5, 16)
    constant = _correct(7, 16, start=9)
    assert (constant.mean() - zero.mean()) / (few.mean() - zero.mean()) == pytest.approx(3.0)
    assert recovered(constant, few, zero) is None


def test_collapsed_only_when_significantly_below_zero_shot():
    zero = _correct(30, 40)
    assert collapsed(_correct(5, 40), zero)
    assert not collapsed(_correct(29, 40), zero) and not collapsed(zero, zero)
    assert not collapsed(_correct(40, 40), zero)


def test_paired_t_matches_scipy_and_refuses_what_it_cannot_judge():
    """The t quantiles against SciPy's (the table is exact to its 4 decimals, the expansion beyond it to
    1e-4), the interval against a hand computation, and the degenerate inputs named."""
    from scipy import stats as sp
    for df in (1, 2, 5, 30, 31, 60, 400):
        assert abs(S.t975(df) - sp.t.ppf(0.975, df)) < 1e-4
    a, b = [100.0, 150.0, 120.0], [200.0, 190.0, 260.0]  # differences -100, -40, -140
    r = S.paired_t(a, b)
    d = np.array([-100.0, -40.0, -140.0])
    half = sp.t.ppf(0.975, 2) * d.std(ddof=1) / np.sqrt(3)
    assert r.value == pytest.approx(-93.333333333, rel=1e-9)
    assert (r.low, r.high) == pytest.approx((d.mean() - half, d.mean() + half), rel=1e-4)
    assert not r.excludes_zero()  # 3 seeds, a wide spread: not significant although all three are below
    assert S.paired_t([1.0, 2.0, 3.0], [2.0, 3.0, 4.0]) == (-1.0, -1.0, -1.0)  # no spread: zero width
    for bad, match in ((([1.0], [2.0]), "at least 2"), (([1.0, np.inf], [0.0, 0.0]), "finite"),
                       (([1.0, 2.0], [1.0]), "one length")):
        with pytest.raises(LiniclError, match=match):
            S.paired_t(*bad)
    with pytest.raises(LiniclError, match="degrees of freedom"):
        S.t975(0)


def test_spread_of_a_few_seeds():
    assert S.spread([1.0, 2.0, 3.0]) == dict(mean=2.0, std=1.0, min=1.0, max=3.0)
    assert S.spread(np.array([0.5])) == dict(mean=0.5, std=0.0, min=0.5, max=0.5)
    with pytest.raises(LiniclError, match="empty"):
        S.spread([])
