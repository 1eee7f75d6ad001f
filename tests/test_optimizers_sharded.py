"""The optimizer table (optimizer_table.py) at stage 2 on N = 4, and at stage 3 on a 2x2 hybrid
mesh with grad_accum=2 and the optimizer state offloaded: every optimizer, the numbers of
single-device optax (test_optimizers.py has stages 0 and 1)."""

import optimizer_table as table
import pytest


@pytest.mark.parametrize("bundle", range(len(table.BUNDLES)))
@pytest.mark.parametrize("config", ["stage2-n4", "stage3-hybrid2x2-accum2-offload"])
def test_optimizer_table_matches_single_device_optax(bundle, config):
    mesh_kw, cfg = {
        "stage2-n4": ({"data": 4}, {"stage": 2}),
        "stage3-hybrid2x2-accum2-offload": ({"replica": 2, "data": 2},
                                            {"stage": 3, "grad_accum": 2,
                                             "offload": "optimizer"}),
    }[config]
    losses, params, _, _ = table.run(bundle, mesh_kw, cfg)
    table.assert_matches(bundle, losses, params)
