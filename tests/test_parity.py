"""Every stage, N ∈ {1, 2, 3, 8}, against single-device optax: 20 AdamW steps, clipping.

N = 4 is not swept here: at N = 2, 4 and 8 no leaf of the test GPT is padded (its sizes are
multiples of 8), so the three run the same code on a data axis of another length; a data axis
of 4 still runs every variant in test_engine.py's hybrid 2 x 4 parity (and at stages 0-3 in
test_optimizers*.py, test_offload.py and test_precision.py)."""

import pytest
from helpers import CLIP, VARIANTS, adamw, check_parity, sweep, tiny_gpt

import zerojax as zj


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n", sweep([1, 2, 3, 8], quick=[3]))  # 3: every leaf padded
def test_parity_with_single_device_optax(variant, n):
    cfg = zj.ZeroConfig(clip_norm=CLIP, **VARIANTS[variant])
    losses = check_parity(zj.Engine(tiny_gpt(), adamw(), zj.make_mesh(data=n), cfg))
    assert losses[-1] < losses[0]  # the run actually trains
