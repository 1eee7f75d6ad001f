"""The `plan` command of `python -m zerojax`: the planner (planning.py) over compiled
candidates, or with `--largest` the largest GPT per stage (largest.py)."""

from __future__ import annotations

import argparse
import json
import sys

from zerojax.analysis.accounting import format_bytes
from zerojax.analysis.commands import (
    _assumptions,
    _gpt_and_batch,
    _label,
    _model_args,
    _start_devices,
)
from zerojax.analysis.console import (
    Parser,
    Progress,
    ints_arg,
    positive_arg,
    print_assumptions,
    print_table,
    size_arg,
    stages_arg,
)
from zerojax.analysis.largest import largest_main
from zerojax.analysis.planning import format_seconds, named_optimizer, plan


def plan_main(argv: list[str]) -> int:
    """`python -m zerojax plan --model 7b --devices 64 --memory 80GB [--json]`; with
    `--largest` instead of `--model`: the largest GPT per stage, estimated."""
    p = Parser(prog="zerojax plan", description="the cheapest configuration that fits")
    _model_args(p, model_required=False)
    p.add_argument("--memory", type=size_arg, required=True, help="per device, e.g. 80GB")
    p.add_argument("--largest", action="store_true",
                   help="instead: the largest GPT shape that fits per stage and remat, "
                        "estimated (nothing compiled; --batch is the global batch)")
    p.add_argument("--stages", type=stages_arg, default="all", help="all or e.g. 0,3")
    p.add_argument("--remat", choices=("both", "on", "off"), default="both",
                   help="recompute each layer in backward: try both, or only on/off")
    p.add_argument("--grad-accum", type=ints_arg, default="1,2,4",
                   help="micro-batch counts to try (the global batch stays the same)")
    p.add_argument("--offload", choices=("auto", "off"), default="auto",
                   help="auto: try stages 1-3 with the optimizer state in host memory only if "
                        "nothing fits without (--largest: add offload columns); off: never")
    p.add_argument("--host-memory", type=size_arg, default=None,
                   help="--largest: host memory per device that offload may use (default: "
                        "not limited)")
    p.add_argument("--bandwidth", type=bandwidth_arg, default=None,
                   help="link bandwidth per device, e.g. 25GB/s, or per mesh axis "
                        "data=400GB/s,replica=25GB/s: rank by time on the links and try ZeRO++ "
                        "(hpZ; qwZ and qgZ unless --quantize off)")
    p.add_argument("--replica", type=positive_arg, default=1,
                   help="with --bandwidth: the devices are R groups (e.g. nodes) joined by the "
                        "replica link; every candidate is also tried on the R x devices/R mesh")
    p.add_argument("--quantize", choices=("int4", "int8", "off"), default=None,
                   help="with --bandwidth: the gradient format qgZ may use (default int4; "
                        "weights: int8), or off for exact options only")
    a = p.parse_args(argv)
    if min(a.grad_accum) < 1:
        p.error(f"--grad-accum {a.grad_accum}: every value must be >= 1")
    if a.largest and (a.bandwidth or a.replica > 1 or a.quantize):
        p.error("--bandwidth, --replica and --quantize weigh compiled programs; --largest "
                "compiles nothing: drop them or use --model")
    if a.largest:
        return largest_main(p, a)
    if a.model is None:
        p.error("the following arguments are required: --model (or --largest)")
    _check_links(p, a)
    _start_devices(p, a.devices)
    from zerojax.errors import ZeroError

    model, batch = _gpt_and_batch(a.model, a.batch or a.devices * max(a.grad_accum))
    remat = {"both": (False, True), "on": (True,), "off": (False,)}[a.remat]
    meshes = 2 if a.replica > 1 else 1
    count = meshes * len(a.stages) * len(remat) * len(a.grad_accum)
    cands = f"{count} candidate{'s' if count > 1 else ''}"
    facts = _assumptions(a, model, batch, **{
        "memory budget": f"{format_bytes(a.memory)} per device for the peak (arguments + "
                         f"outputs - donated + temp)",
        "searched": f"stages {','.join(map(str, a.stages))} x remat "
                    f"{'/'.join('on' if r else 'off' for r in remat)} x grad_accum "
                    f"{','.join(map(str, a.grad_accum))}"
                    + (f" x mesh {a.devices}/{a.replica}x{a.devices // a.replica}"
                       if meshes > 1 else "")
                    + f" = {cands}; the least "
                    + ("time on the links" if a.bandwidth else "traffic") + " that fits wins",
        "offload": "stages 1-3 with the optimizer state in host memory are tried only if "
                   "nothing fits without (peak: device memory)" if a.offload == "auto" else
                   "off", **_link_facts(a)})
    print_assumptions(f"zerojax plan: {a.model} on {a.devices} devices", facts)
    progress = Progress(count)
    quantize = None if a.quantize == "off" else a.quantize or "int4"
    try:
        result = plan(model, a.devices, a.memory, batch, optimizer=named_optimizer(a.optimizer),
                      param_dtype=a.param_dtype,
                      stages=a.stages, remat=remat, grad_accum=a.grad_accum,
                      offload=a.offload == "auto", replica=a.replica, bandwidth=a.bandwidth,
                      quantize=quantize,
                      progress=lambda c, phase, i, n: progress(
                          _plan_label(c, a.devices), phase, i, n))
    except ZeroError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    finally:
        seconds = progress.close()
    more = len(result.candidates) - count
    if result.offload_searched:
        offloaded = sum(c.offload is not None and not c.zeropp() for c in result.candidates)
        cands, more = f"{cands} + {offloaded} with offload (nothing fit without it)", \
            more - offloaded
    if more:
        cands = f"{cands} + {more} ZeRO++ variants of the best that fit"
    print(f"searched {cands} in {seconds:.0f} s", file=sys.stderr)
    if a.json:
        print(json.dumps({"model": a.model, "optimizer": a.optimizer, "assumptions": facts,
                          **result.as_dict()}, indent=1))
        return 0 if result.best else 1
    fmt = lambda v: "-" if v is None else format_bytes(v)
    links = result.bandwidth is not None
    rows = [{"stage": c.stage, "remat": "on" if c.remat else "off", "accum": c.grad_accum,
             **({"offload": c.offload or "-", "host": fmt(c.host_bytes)}
                if result.offload_searched else {}),
             **({"mesh": f"{c.replica}x{a.devices // c.replica}" if c.replica > 1 else
                 str(a.devices)} if a.replica > 1 else {}),
             **({"zero++": c.zeropp() or "-"} if links else {}),
             "state": fmt(c.state_bytes), "peak": fmt(c.peak_bytes),
             "sent/step": fmt(c.comm_bytes),
             **({"time/step": "-" if c.comm_seconds is None else format_seconds(c.comm_seconds)}
                if links else {}),
             "launches": c.launches or "-",
             "fits": "yes" if c.fits else "no", "chosen": "<==" if c.chosen else "",
             "reason": c.reason} for c in result.candidates]
    print_table(f"{a.model} on {a.devices} devices with {format_bytes(a.memory)} each", rows)
    for note in result.notes():
        print(f"note: {note}")
    if result.best is None:
        print("nothing fits: more devices, a smaller batch, or a smaller model", file=sys.stderr)
        return 1
    b = result.best
    host = f" + offload ({format_bytes(b.host_bytes)} in host memory)" if b.offload else ""
    mesh = f" on make_mesh(replica={b.replica}, data={a.devices // b.replica})" \
        if b.replica > 1 else ""
    zeropp = f" + {b.zeropp()}" if b.zeropp() else ""
    time = f" ({format_seconds(b.comm_seconds)} on the links)" if links else ""
    print(f"chosen: stage {b.stage}{host}{zeropp}, remat {'on' if b.remat else 'off'}, "
          f"grad_accum {b.grad_accum}{mesh}: peak {format_bytes(b.peak_bytes)}, "
          f"sends {format_bytes(b.comm_bytes)} per step per device{time}")
    return 0


def _check_links(p: Parser, a) -> None:
    """Usage errors among --bandwidth, --replica and --quantize (before anything compiles)."""
    axes = set(a.bandwidth) if isinstance(a.bandwidth, dict) else set()
    if a.replica > 1 and a.bandwidth is None:
        p.error(f"--replica {a.replica} weighs the link between replicas against the one "
                f"within: give --bandwidth data=...,replica=... (e.g. data=400GB/s,"
                f"replica=25GB/s)")
    if a.quantize and a.bandwidth is None:
        p.error(f"--quantize {a.quantize} needs --bandwidth: without link speeds plan never "
                f"quantizes (it changes the numbers)")
    if a.devices % a.replica:
        p.error(f"--devices {a.devices} do not split into --replica {a.replica} groups; "
                f"give a --replica that divides --devices")
    if "replica" in axes and a.replica == 1:
        p.error("--bandwidth names a replica link but --replica is 1: give --replica R (the "
                "number of groups, e.g. nodes) or name only data=...")
    want = {"data", "replica"} if a.replica > 1 else {"data"}
    if axes and axes != want:
        p.error(f"--bandwidth {','.join(sorted(axes))}: with --replica {a.replica} name "
                f"{' and '.join(sorted(want))} (or give one figure for every link)")


def _link_facts(a) -> dict[str, str]:
    """The assumptions' lines for --bandwidth / --replica."""
    if a.bandwidth is None:
        return {}
    links = a.bandwidth if isinstance(a.bandwidth, dict) else {"every link": a.bandwidth}
    zeropp = ("hpZ (exact)" if a.replica > 1 else "") if a.quantize == "off" else \
        f"qwZ int8 + qgZ {a.quantize or 'int4'}" + (", hpZ" if a.replica > 1 else "")
    return {"links": ", ".join(f"{axis} {format_bytes(bw)}/s" for axis, bw in links.items())
            + (f"; {a.replica} groups of {a.devices // a.replica} devices"
               if a.replica > 1 else ""),
            "zero++": (f"{zeropp} tried on the best that fits per stage"
                       + (" and mesh" if a.replica > 1 else "") if zeropp else "none")
            + "; the least time on the links wins, exact before quantized among equals"}


def _plan_label(c, devices: int) -> str:
    """A plan candidate in words: its mesh (where it has a replica axis), the options."""
    mesh = f" on {c.replica}x{devices // c.replica}" if c.replica > 1 else ""
    zeropp = f" + {c.zeropp()}" if c.zeropp() else ""
    return _label(c.stage, c.remat, c.grad_accum, c.offload) + mesh + zeropp


def bandwidth_arg(text: str) -> float | dict[str, float]:
    """`25GB/s` (every link) or `data=400GB/s,replica=25GB/s` -> bytes per second."""
    from zerojax.analysis.console import parse_bytes

    def one(value: str) -> float:
        bw = -1 if value.strip().startswith("-") else parse_bytes(value.strip().removesuffix("/s"))
        if not bw > 0:
            raise ValueError(f"{value!r} must be more than 0 bytes per second")
        return float(bw)

    try:
        if "=" not in text:
            return one(text)
        links = {}
        for part in text.split(","):
            axis, _, value = part.partition("=")
            if axis.strip() not in ("data", "replica"):
                raise ValueError(f"{axis.strip()!r} is not a mesh axis; name data and replica, "
                                 f"e.g. data=400GB/s,replica=25GB/s")
            links[axis.strip()] = one(value)
        return links
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
