"""The `plan --largest` command: per stage and remat, the largest GPT shape whose estimated
peak fits, with and without optimizer offload (the host tier or the NVMe tier), printed as a
table or JSON (the search itself: largest.py)."""

from __future__ import annotations

import json
import os
import shutil
import sys

from zerojax.analysis.accounting import (
    PINNED_LIMIT_DEFAULT_GB,
    PINNED_LIMIT_ENV,
    format_bytes,
    nvme_ring_bytes,
    pinned_limit,
)
from zerojax.analysis.console import print_assumptions, print_table
from zerojax.analysis.estimate_args import EstimateError
from zerojax.analysis.largest import (
    FAMILY_PRESETS,
    HOST_MARGIN,
    TWIN_STEP,
    activation_bytes,
    gpt_family,
    largest,
    state_per_param,
    twin_flow_fraction,
)
from zerojax.analysis.planning import named_optimizer


def _optimizer_fact(name: str, optimizer, family) -> str:
    if optimizer is None:
        return ("AdamW, moments in float32 (state: zerojax.analysis.accounting.state_estimate, "
                "grads included)")
    from zerojax.app.presets import STATE, TITLE

    ks = [state_per_param(optimizer, c) for c in family.values()]
    return (f"{TITLE[name]}, {STATE[name]} in float32: K = {min(ks):.4g} to {max(ks):.4g} "
            f"bytes per param over the shapes, read from its init (AdamW: 8); state: "
            f"zerojax.analysis.accounting.state_estimate, grads included")


def disk_budget(p, a) -> tuple[float | None, str]:
    """`plan --largest`'s disk per device for the NVMe tier's store, and where it comes from:
    `--nvme-bytes` (per device), or the free space of `--nvme-path`'s file system shared by the
    `--devices` (one process drives them all); (None, "") where neither is given."""
    device = getattr(a, "offload_device", "cpu")
    path, size = getattr(a, "nvme_path", None), getattr(a, "nvme_bytes", None)
    given = [f for f, v in (("--nvme-path", path), ("--nvme-bytes", size)) if v is not None]
    if device == "nvme" and a.offload == "off":
        p.error("--offload-device nvme sizes the offload columns, which --offload off drops; "
                "use --offload auto")
    if given and device != "nvme":
        p.error(f"{' and '.join(given)} size the NVMe tier's disk; add --offload-device nvme")
    if len(given) == 2:
        p.error("--nvme-path and --nvme-bytes both give the disk; drop one of them")
    if size is not None:
        if not size > 0:
            p.error(f"--nvme-bytes {size:g}: give the disk space per device the NVMe store "
                    f"may use, e.g. 2TB, more than 0 bytes")
        return float(size), "--nvme-bytes"
    if path is None:
        return None, ""
    if not os.path.isdir(path):
        p.error(f"--nvme-path {path}: no such directory; give an existing directory on the "
                f"disk the store will use, or --nvme-bytes")
    free = shutil.disk_usage(path).free
    share = f" / {a.devices} devices" if a.devices > 1 else ""
    return free / a.devices, f"{path}'s free space, {format_bytes(free)}{share}"


def largest_main(p, a) -> int:
    """`plan --largest`: per stage and remat, the largest shape of `gpt_family()` whose estimated
    peak fits `--memory`, from formulas alone."""
    if a.model is not None:
        p.error(f"--largest searches GPT shapes itself; drop --model {a.model}")
    batch = a.batch or a.devices
    if batch % a.devices:
        p.error(f"--batch {batch} is not divisible by --devices {a.devices}; use a multiple")
    b = batch // a.devices
    remat = {"both": (True, False), "on": (True,), "off": (False,)}[a.remat]
    family = gpt_family()
    # AdamW's init gives Adam's 8 bytes per param on every shape: None says so, at no cost.
    optimizer = None if a.optimizer == "adamw" else named_optimizer(a.optimizer)
    kw = dict(batch_per_device=b, param_dtype=a.param_dtype, stages=a.stages, remat=remat,
              family=family, optimizer=optimizer)
    delayed = getattr(a, "delayed_update", None)
    if delayed is not None and a.offload == "off":
        p.error(f"--delayed-update {delayed} sizes the offload columns, which --offload off "
                f"drops; use --offload auto")
    host, host_margin = a.host_memory, getattr(a, "host_margin", HOST_MARGIN)
    if host is not None and not host > 0:
        p.error(f"--host-memory {host:g}: give the host memory per device that offload may "
                f"use, e.g. 125GB, or leave it out (not limited)")
    device = getattr(a, "offload_device", "cpu")
    disk, disk_from = disk_budget(p, a)
    try:
        pinned = None if a.pinned_limit == "none" else a.pinned_limit or pinned_limit()
        rows = largest(a.devices, a.memory, **kw)
        off = {} if a.offload == "off" else {
            (r["stage"], r["remat"]): r for r in largest(
                a.devices, a.memory, **kw, offload="optimizer", host_memory=host,
                pinned=pinned, delayed_update=delayed, host_margin=host_margin,
                offload_device=device, disk=disk)}
    except EstimateError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    dtype = a.param_dtype
    sample = activation_bytes(family["1b"], b, dtype, True)
    facts = {
        "memory budget": f"{format_bytes(a.memory)} per device for the estimated peak",
        "devices": f"{a.devices} (data parallel; stages 1-3 shard over all of them)",
        "global batch": f"{batch} sequence{'s' if batch > 1 else ''} ({b} per device), "
                        "no grad_accum",
        "sequence length": ", ".join(sorted({str(c.seq_len) for c in family.values()})),
        "params and grads": f"{dtype}",
        "master params": "float32" if dtype != "float32" else
                         "the float32 params themselves in stages 0 and 3",
        "optimizer": _optimizer_fact(a.optimizer, optimizer, family),
        "activations": "Korthikanti et al. 2022 per layer, b·T·d·(34 + 5·a·T/d) at 2 bytes "
                       "(scaled to the dtype; attention scores counted, as XLA's attention "
                       "keeps them), the logits in compute dtype + float32 log-softmax and "
                       f"gradient (1b with remat: {format_bytes(sample['total'])})",
        "remat": "on: each layer keeps its input, one layer recomputed at a time; off: every "
                 "layer keeps all",
        "stage 3": "+ one gathered unit (the largest layer or vocabulary table) and its "
                   "gradient in compute dtype",
        "shapes": f"{len(family)} GPT shapes: the presets {', '.join(FAMILY_PRESETS)} and "
                  f"GPT-3's table and neighbours (d_ff = 4d); see largest.gpt_family",
        "not modelled": "fragmentation, XLA's extra temps, collective buffers: keep a margin "
                        "(zerojax measure compiles the step and reads the real peak)",
    }
    state = ("master and Adam moments, 12 bytes x Ψ/N per device" if optimizer is None else
             "master and the optimizer state, (4 + K) bytes x Ψ/N per device")
    if off and device == "nvme":
        facts["offload"] = (
            "the + offload (nvme) columns: stages 1-3 with offload='optimizer', offload_device="
            "'nvme' (ZeRO-Infinity, docs/nvme.md): the device holds the compute params, "
            "gradients and activations (peak); the disk holds the float32 " + state
            + " (each device's shard of its process's store), which must fit the disk, "
            + (f"at most {format_bytes(disk)} per device ({disk_from})" if disk is not None
               else "not limited (--nvme-path DIR or --nvme-bytes)")
            + f"; host: the ring of I/O buffers the update streams it through, "
            f"{format_bytes(nvme_ring_bytes())} per device (ZeroConfig's nvme_buffer_count "
            f"x 3 x 4 bytes x nvme_buffer_size, their defaults); host peak: "
            "the ring + the gradient shard that comes down + the compute shard that goes up, "
            "which must fit the host memory, ")
    elif off:
        facts["offload"] = (
            "the + offload columns: stages 1-3 with offload='optimizer': the device holds the "
            "compute params, gradients and activations (peak); the host holds the float32 "
            + state
            + "; host peak: that state + the gradient shard that comes down + the compute shard "
            "that goes up (the update runs in place), which must fit the host memory, ")
    if off:
        facts["offload"] += (
            (f"at most {format_bytes(host * (1 - host_margin))} ({format_bytes(host)} "
               f"less a {100 * host_margin:g}% margin for the operating system, the runtime "
               f"and the data: --host-margin)" if host is not None else "not limited")
            + ", and XLA:GPU's pinned-host pool, "
            + (("not limited" if not pinned else f"at most {format_bytes(pinned)}")
               + (" (--pinned-limit)" if a.pinned_limit else
                  f" (${PINNED_LIMIT_ENV} GiB, else XLA's {PINNED_LIMIT_DEFAULT_GB} GiB)"))
            + "; each step the gradient shard goes down and the compute shard comes up"
            + (f"; --delayed-update {delayed}: + the pending gradient shard, Ψ/N in the "
               "gradient's dtype, in host (and host peak), + the next step's compute shard, "
               "in the device peak" if delayed is not None else "")
            + "; binds: the memories the next larger shape does not fit; Twin-Flow: the "
            f"least --offload-fraction (in steps of {TWIN_STEP}) whose devices' share of that "
            f"{'host state' if device == 'cpu' else 'state on disk'} fits beside the device "
            f"peak in the memory budget less --margin "
            f"({100 * a.margin:g}%), so the devices update that share")
    print_assumptions(f"zerojax plan --largest: {a.devices} devices with "
                       f"{format_bytes(a.memory)} each", facts)
    if a.json:
        def both(r):
            out = {"fits": r["fits"] and r["fits"].as_dict(),
                   "next": r["next"] and r["next"].as_dict(), "binds": r["binds"]}
            if r["offload"] and r["fits"]:
                out["twin_flow_fraction"] = twin_flow_fraction(r["fits"], a.memory,
                                                               margin=a.margin)
            return out

        out = [{"stage": r["stage"], "remat": r["remat"], **both(r),
                "offload": both(off[k]) if (k := (r["stage"], r["remat"])) in off else None}
               for r in rows]
        print(json.dumps({"devices": a.devices, "device_memory": a.memory, "batch": batch,
                          "host_memory": host, "host_margin": host_margin,
                          "pinned_limit": pinned,
                          "offload_device": None if a.offload == "off" else device,
                          "disk": disk, "nvme_path": getattr(a, "nvme_path", None),
                          "param_dtype": dtype, "assumptions": facts, "largest": out},
                         indent=1))
        return 0 if any(r["fits"] for r in [*rows, *off.values()]) else 1
    fmt = format_bytes
    table = []
    for r in rows:
        f, nx = r["fits"], r["next"]
        table.append({
            "stage": r["stage"], "remat": "on" if r["remat"] else "off",
            "largest": f.name if f else "none",
            "params": f"{f.num_params / 1e9:.2f}B" if f else "-",
            "peak": fmt(f.peak) if f else "-", "state": fmt(f.state) if f else "-",
            "activations": fmt(f.activations) if f else "-",
            "stage-3 unit": fmt(f.gathered) if f and f.gathered else "-",
            "next larger": f"{nx.name} ({nx.num_params / 1e9:.2f}B): {fmt(nx.peak)}"
                           if nx else "-"})
        if off:
            o = off.get((r["stage"], r["remat"]))
            fo = o and o["fits"]
            table[-1].update({
                "+ offload" + (" (nvme)" if device == "nvme" else ""):
                    fo.name if fo else "none" if o else "-",
                "offload params": f"{fo.num_params / 1e9:.2f}B" if fo else "-",
                "device peak": fmt(fo.peak) if fo else "-",
                "host": fmt(fo.host) if fo else "-",
                "host peak": fmt(fo.host_peak) if fo else "-",
                **({"disk": fmt(fo.on_disk) if fo else "-"} if device == "nvme" else {}),
                "host<->device": fmt(fo.transfer) if fo else "-",
                "binds": " + ".join(o["binds"]) if o and o["binds"] else "-",
                "Twin-Flow": "--offload-fraction "
                             f"{twin_flow_fraction(fo, a.memory, margin=a.margin):.2f}"
                             if fo else "-"})
    print_table(f"Largest GPT per stage on {a.devices} devices with {format_bytes(a.memory)} "
                 f"each (estimated)", table)
    if not any(r["fits"] for r in [*rows, *off.values()]):
        print(f"nothing fits: the smallest shape, {next(iter(family))}, needs more than "
              f"{format_bytes(a.memory)}", file=sys.stderr)
        return 1
    return 0
