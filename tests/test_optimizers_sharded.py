"""The optimizer table (optimizer_table.py) at stage 0 on N = 4, and at stage 3 on a 2x2 hybrid
mesh with grad_accum=2 and the optimizer state offloaded: every optimizer, the numbers of
single-device optax (test_optimizers.py has stages 1 and 2)."""

import optimizer_table as table
import pytest
from helpers import sweep


@pytest.mark.parametrize("bundle", range(len(table.BUNDLES)))
@pytest.mark.parametrize("config", sweep(["stage0-n4", "stage3-hybrid2x2-accum2-offload"],
                                         quick=["stage3-hybrid2x2-accum2-offload"]))
def test_optimizer_table_matches_single_device_optax(bundle, config):
    losses, params, _ = table.run(bundle, config)
    table.assert_matches(bundle, losses, params)
