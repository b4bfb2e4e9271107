"""Axis 2: coefficient streams, hand-computed, and their invariances."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import normalizers

# Two groups of two rows; lengths (2, 4, 0, 3) in T = 5.
LENGTHS = np.array([2, 4, 0, 3])
MASK = (np.arange(5)[None, :] < LENGTHS[:, None]).astype(np.float32)


def _row_values(coef):
    """The single coefficient of each row (0 for an empty row)."""
    c = np.asarray(coef)
    return np.array([c[b, 0] if LENGTHS[b] else 0.0 for b in range(len(LENGTHS))])


class CoefficientsTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_values(self):
        cases = {
            # B' = 3 non-empty rows: 1 / (3 L_b).
            "seq_mean_token_mean": [1 / 6, 1 / 12, 0, 1 / 9],
            "seq_mean": [1 / 6, 1 / 12, 0, 1 / 9],
            # sum L = 9.
            "token_mean": [1 / 9] * 3 + [1 / 9],
            # Group sums 6 and 3, G' = 2: 1/12 for group 0, 1/6 for group 1.
            "group_token_mean": [1 / 12, 1 / 12, 1 / 6, 1 / 6],
            # B' = 3.
            "seq_mean_token_sum": [1 / 3, 1 / 3, 0, 1 / 3],
            # B L_max = 4 * 8 = 32 (the empty row still counts in B).
            "token_sum_norm": [1 / 32] * 4,
        }
        for mode, want in cases.items():
            coef = self.variant(
                lambda m: normalizers.coefficients(m, mode=mode, group_size=2,
                                                   max_tokens=8))(jnp.asarray(MASK))
            np.testing.assert_allclose(_row_values(coef) * (LENGTHS > 0),
                                       np.array(want) * (LENGTHS > 0), rtol=1e-6)
            assert np.all(np.asarray(coef)[MASK == 0] == 0.0), mode

    def test_mean_modes_sum_to_one(self):
        # Each "mean" mode is a weighted average: coefficients sum to 1.
        for mode in ("seq_mean_token_mean", "token_mean", "group_token_mean", "seq_mean"):
            c = normalizers.coefficients(jnp.asarray(MASK), mode=mode, group_size=2)
            np.testing.assert_allclose(np.sum(c), 1.0, rtol=1e-6)
        c = normalizers.coefficients(jnp.asarray(MASK), mode="seq_mean")
        np.testing.assert_allclose(normalizers.row_coefficients(c),
                                   [1 / 3, 1 / 3, 0, 1 / 3], rtol=1e-6)

    def test_empty_batch_is_zero_not_nan(self):
        for mode in normalizers.MODES:
            c = normalizers.coefficients(jnp.zeros((4, 5)), mode=mode, group_size=2,
                                         max_tokens=8)
            assert np.all(np.asarray(c) == 0.0), mode

    def test_weighted_coefficients(self):
        w = jnp.asarray(MASK) * 0.1
        w = w.at[0, 0].set(0.0)  # weight 0 leaves numerator and denominator
        c = normalizers.weighted_coefficients(w, mode="token_mean")
        # 8 tokens with weight .1 remain: .1 / 8.
        np.testing.assert_allclose(np.asarray(c)[1, 0], 0.1 / 8, rtol=1e-6)
        assert np.asarray(c)[0, 0] == 0.0

    def test_errors_name_the_field(self):
        with pytest.raises(ValueError, match="loss.norm.*token_mean"):
            normalizers.coefficients(jnp.asarray(MASK), mode="mean")
        with pytest.raises(ValueError, match="max_tokens"):
            normalizers.coefficients(jnp.asarray(MASK), mode="token_sum_norm")
        with pytest.raises(ValueError, match="group_size"):
            normalizers.coefficients(jnp.asarray(MASK), mode="group_token_mean",
                                     group_size=3)
