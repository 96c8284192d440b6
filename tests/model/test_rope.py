"""YaRN frequencies and temperature (moestack/model/rope.py), DeepSeek's form, against the formulas by hand."""

from __future__ import annotations

import math

import pytest
import torch

from moestack.config.model_spec import RopeScalingSpec
from moestack.model.rope import rope_cos_sin, yarn_inv_freq

DSV3 = dict(type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=1.0)  # DeepSeek-V3 config.json, rope dim 64, theta 10000


def test_yarn_keeps_fast_pairs_and_interpolates_slow_ones():
    dim, theta = 64, 10000.0
    inv = yarn_inv_freq(dim, theta, RopeScalingSpec(**DSV3))
    base = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    # pair index turning r times over 4096 tokens: dim ln(4096 / (2 pi r)) / (2 ln theta)
    lo = math.floor(dim * math.log(4096 / (2 * math.pi * 32)) / (2 * math.log(theta)))  # 10
    hi = math.ceil(dim * math.log(4096 / (2 * math.pi * 1)) / (2 * math.log(theta)))  # 23
    assert (lo, hi) == (10, 23)
    torch.testing.assert_close(inv[: lo + 1], base[: lo + 1], rtol=0, atol=0)  # extrapolated: unchanged
    torch.testing.assert_close(inv[hi:], base[hi:] / 40, rtol=1e-15, atol=0)  # interpolated
    ratio = inv / base
    assert (ratio[1:] <= ratio[:-1] + 1e-12).all() and ratio.min() == pytest.approx(1 / 40)
    mid = lo + 6  # on the linear ramp: weight (i - lo) / (hi - lo) on the interpolated frequency
    w = (mid - lo) / (hi - lo)
    assert float(inv[mid]) == pytest.approx(float(base[mid]) * (w / 40 + 1 - w), rel=1e-12)


def test_yarn_factor_one_is_plain_rope_and_mscale_scales_cos_sin():
    pos = torch.arange(50)
    plain = rope_cos_sin(pos, 16, 500.0, torch.float64)
    same = rope_cos_sin(pos, 16, 500.0, torch.float64, RopeScalingSpec(**{**DSV3, "factor": 1.0,
                                                                         "original_max_position_embeddings": 16}))
    for a, b in zip(plain, same):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-15)
    # mscale == mscale_all_dim: unit rotations; mscale_all_dim unset: cos / sin carry the temperature
    cos, sin = rope_cos_sin(pos, 64, 1e4, torch.float64, RopeScalingSpec(**DSV3))
    torch.testing.assert_close(cos**2 + sin**2, torch.ones_like(cos))
    cos, sin = rope_cos_sin(pos, 64, 1e4, torch.float64, RopeScalingSpec(**{**DSV3, "mscale_all_dim": None}))
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, (0.1 * math.log(40) + 1) ** 2))
