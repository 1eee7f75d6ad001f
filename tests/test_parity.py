"""Every stage, N ∈ {1, 2, 3, 4, 8}, against single-device optax: 20 AdamW steps, clipping."""

import pytest
from helpers import CLIP, VARIANTS, adamw, check_parity, sweep, tiny_gpt

import zerojax as zj


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n", sweep([1, 2, 3, 4, 8], quick=[3]))  # 3: every leaf padded
def test_parity_with_single_device_optax(variant, n):
    cfg = zj.ZeroConfig(clip_norm=CLIP, **VARIANTS[variant])
    losses = check_parity(zj.Engine(tiny_gpt(), adamw(), zj.make_mesh(data=n), cfg))
    assert losses[-1] < losses[0]  # the run actually trains


