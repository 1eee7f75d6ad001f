"""ZeRO-Offload: the tiers below the device (host memory and NVMe), a wing of its own.

`ZeroConfig(offload="optimizer")` keeps the fp32 master and the optimizer state on the host's
CPU devices and runs the update there; the optimizer's arithmetic is update/'s (the same
`ShardedUpdate`, whole or in the parts it splits into), which knows nothing of this wing.
`Engine` enters it only for an engine that offloads (`Engine._offload`, host.py's
`HostOffload`); the checkpoint wing uses its programs over two meshes (meshes.py).

Modules: meshes.py (the host mesh; moves and programs over arrays on two meshes), host.py
(the offloaded step and the state built on two meshes), programs.py (its programs, made once
per plan), moves.py (what a step moves between the meshes), side_by_side.py (the update's
parts run side by side, each from a thread of its own), twin_flow.py (which leaves stay on the
devices: Twin-Flow; where each hosted leaf lives), delayed.py (the delayed update: DPU),
fused.py and fused_adamw.cc (`zerojax.adamw`: the host update as one fused pass per leaf,
built at first use), store.py, nvme.py and nvme_adamw.cc (the NVMe tier: the state in
files, streamed through the same arithmetic, adamw_math.h), disk.py (the NVMe tier in the
engine, `offload_device="nvme"`; `offload_of` picks the tier) and disk_delayed.py (its
delayed update's dry passes).
"""
