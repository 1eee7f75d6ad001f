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
    _shape_given,
    _start_devices,
    model_config,
)
from zerojax.analysis.console import (
    Parser,
    Progress,
    ints_arg,
    non_negative_arg,
    positive_arg,
    print_assumptions,
    print_table,
    size_arg,
    stages_arg,
)
from zerojax.analysis.largest_command import largest_main
from zerojax.analysis.plan_report import chosen_line, rows, title
from zerojax.analysis.planning import named_optimizer, plan
from zerojax.analysis.steptime import EFFICIENCY
from zerojax.config import OFFLOAD_DEVICES


def pinned_arg(text: str) -> int | str:
    """A size, or "none" (no pinned-host limit)."""
    return "none" if text.lower() == "none" else size_arg(text)


def plan_main(argv: list[str]) -> int:
    """`python -m zerojax plan --model 7b --devices 64 --memory 80GB [--json]`; with
    `--largest` instead of `--model`: the largest GPT per stage, estimated."""
    p = Parser(prog="zerojax plan", description="the cheapest configuration that fits")
    _model_args(p, model_required=False)
    p.add_argument("--memory", type=size_arg, required=True, help="per device, e.g. 80GB")
    p.add_argument("--margin", type=percent_arg, default="10%",
                   help="device memory kept free: a peak fits in the rest (e.g. 10%%, 0)")
    p.add_argument("--largest", action="store_true",
                   help="instead: the largest GPT shape that fits per stage and remat, "
                        "estimated (nothing compiled; --batch is the global batch)")
    p.add_argument("--stages", type=stages_arg, default="all", help="all or e.g. 0,3")
    p.add_argument("--remat", choices=("both", "on", "off"), default="both",
                   help="recompute each layer in backward: try both, or only on/off")
    p.add_argument("--grad-accum", type=ints_arg, default="1,2,4",
                   help="micro-batch counts to try (the global batch stays the same)")
    p.add_argument("--model-parallel", type=model_parallel_arg, default="auto",
                   help="model-axis sizes M to try (mesh data x model), e.g. 1,2,4; auto: "
                        "M = 1, and only if nothing fits every M the devices and the model's "
                        "split dimensions (and heads) allow")
    p.add_argument("--offload", choices=("auto", "off"), default="auto",
                   help="auto: try stages 1-3 with the optimizer state in host memory only if "
                        "nothing fits without (--largest: add offload columns); off: never")
    p.add_argument("--host-memory", type=size_arg, default=None,
                   help="--largest: host memory per device that offload may use, e.g. 125GB "
                        "(default: not limited)")
    p.add_argument("--host-margin", type=percent_arg, default="10%",
                   help="--largest: host memory kept free for the operating system, the "
                        "runtime and the data: a host peak fits in the rest (e.g. 10%%, 0)")
    p.add_argument("--pinned-limit", type=pinned_arg, default=None,
                   help="--largest: XLA:GPU's pinned-host pool per device, which offload's "
                        "gradient shard on its way to the host must fit, e.g. 110GiB, or none "
                        "(default: "
                        "$XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB GiB, else XLA's 64 GiB)")
    p.add_argument("--offload-device", choices=OFFLOAD_DEVICES, default="cpu",
                   help="--largest: where the offload columns keep the optimizer state: cpu "
                        "(host memory) or nvme (ZeRO-Infinity: on disk, streamed through a "
                        "ring of host buffers; adds a disk column)")
    p.add_argument("--nvme-path", default=None, metavar="DIR",
                   help="--largest --offload-device nvme: the directory of the store; its file "
                        "system's free space, shared by the --devices, bounds the state on disk")
    p.add_argument("--nvme-bytes", type=disk_arg, default=None,
                   help="--largest --offload-device nvme: disk space per device the store may "
                        "use, e.g. 2TB, instead of --nvme-path (default: not limited)")
    p.add_argument("--delayed-update", type=non_negative_arg, default=None, metavar="K",
                   help="--largest: the offload columns with the delayed parameter update "
                        "(train --delayed-update K): + its pending gradient shard in host "
                        "memory and the next compute shard on the device")
    p.add_argument("--bandwidth", type=bandwidth_arg, default=None,
                   help="link bandwidth per device, e.g. 25GB/s, or per mesh axis "
                        "data=400GB/s,replica=25GB/s,model=900GB/s (model: default data's): "
                        "rank by step time (compute + the link time it does not hide) and try "
                        "ZeRO++ (hpZ; qwZ and qgZ unless --quantize off)")
    p.add_argument("--replica", type=positive_arg, default=1,
                   help="with --bandwidth: the devices are R groups (e.g. nodes) joined by the "
                        "replica link; every candidate is also tried on the R x devices/R mesh")
    p.add_argument("--quantize", choices=("int4", "int8", "off"), default=None,
                   help="with --bandwidth: the gradient format qgZ may use (default int4; "
                        "weights: int8), or off for exact options only; a quantized option "
                        "must shorten the step by 5%%")
    p.add_argument("--device", default=None,
                   help="with --bandwidth: the device kind compute is timed on, from the peak "
                        "table (e.g. h100, a100, b200; default: this machine's GPU, or an "
                        "H100 when planning on CPU)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="with --bandwidth: the device's peak TFLOP/s instead of the table's")
    p.add_argument("--efficiency", type=float, default=EFFICIENCY,
                   help="with --bandwidth: the fraction of the peak compute runs at (MFU; "
                        "0.45: measured on one H100 for the 1b preset, docs/performance.md)")
    a = p.parse_args(argv)
    if min(a.grad_accum) < 1:
        p.error(f"--grad-accum {a.grad_accum}: every value must be >= 1")
    compute = [f for f, v in (("--device", a.device), ("--peak-tflops", a.peak_tflops),
                              ("--efficiency", a.efficiency != EFFICIENCY or None)) if v]
    if a.largest and (a.bandwidth or a.replica > 1 or a.quantize or compute
                      or a.model_parallel is not None):
        p.error("--bandwidth, --replica, --quantize, --device, --peak-tflops, --efficiency "
                "and --model-parallel weigh compiled programs; --largest compiles nothing: "
                "drop them or use --model")
    if a.largest and (_shape_given(a) or a.params is not None):
        p.error("--largest searches GPT shapes itself; drop the shape flags and --params")
    if a.delayed_update is not None and not a.largest:
        p.error(f"--delayed-update {a.delayed_update} sizes --largest's offload columns; add "
                f"--largest")
    nvme = [f for f, v in (("--offload-device nvme", a.offload_device == "nvme" or None),
                           ("--nvme-path", a.nvme_path), ("--nvme-bytes", a.nvme_bytes)) if v]
    if nvme and not a.largest:
        p.error(f"{', '.join(nvme)} size --largest's offload columns; add --largest")
    if a.largest:
        return largest_main(p, a)
    name, shape = model_config(p, a)
    if shape is None:
        p.error("the following arguments are required: --model (or --largest), or a shape "
                "(--layers --d-model ...), or --params")
    if compute and a.bandwidth is None:
        p.error(f"{', '.join(compute)} time the compute of a step, which only --bandwidth "
                f"weighs against the links: add --bandwidth")
    if a.peak_tflops is not None and not a.peak_tflops > 0:
        p.error(f"--peak-tflops {a.peak_tflops}: give the device's peak TFLOP/s, > 0")
    if not 0 < a.efficiency <= 1:
        p.error(f"--efficiency {a.efficiency}: give the fraction of the peak compute runs at, "
                f"in (0, 1]")
    _check_links(p, a)
    _start_devices(p, a.devices)
    import jax

    from zerojax.analysis.steptime import target_peak
    from zerojax.errors import ZeroError

    try:
        peak, where = target_peak(a.peak_tflops, a.device, jax.devices()[0])
    except ZeroError as e:  # an unknown --device: one line, before anything compiles
        p.error(str(e))

    model, batch = _gpt_and_batch(shape, a.batch or a.devices * max(a.grad_accum))
    remat = {"both": (False, True), "on": (True,), "off": (False,)}[a.remat]
    meshes = 2 if a.replica > 1 else 1
    sizes = a.model_parallel or (1,)
    count = meshes * len(sizes) * len(a.stages) * len(remat) * len(a.grad_accum)
    cands = f"{count} candidate{'s' if count > 1 else ''}"
    facts = _assumptions(a, name, model, batch, **{
        "memory budget": f"{format_bytes(a.memory)} per device, less a {100 * a.margin:g}% "
                         f"margin, for the peak (arguments + outputs - donated + temp)",
        "searched": f"stages {','.join(map(str, a.stages))} x remat "
                    f"{'/'.join('on' if r else 'off' for r in remat)} x grad_accum "
                    f"{','.join(map(str, a.grad_accum))}"
                    + (f" x mesh {a.devices}/{a.replica}x{a.devices // a.replica}"
                       if meshes > 1 else "")
                    + (f" x model {','.join(map(str, sizes))}" if len(sizes) > 1 else "")
                    + f" = {cands}; the least "
                    + ("step time" if a.bandwidth else "traffic") + " that fits wins",
        "model axis": (f"model {', '.join(map(str, sizes))} (mesh replica x data x model)"
                       if a.model_parallel else
                       "model = 1; if nothing fits, every model-axis size the devices and the "
                       "model's split dimensions and heads allow"),
        "offload": "stages 1-3 with the optimizer state in host memory are tried only if "
                   "nothing fits without (peak: device memory)" if a.offload == "auto" else
                   "off", **_link_facts(a, peak, where)})
    print_assumptions(f"zerojax plan: {name} on {a.devices} devices", facts)
    progress = Progress(count)
    quantize = None if a.quantize == "off" else a.quantize or "int4"
    try:
        result = plan(model, a.devices, a.memory, batch, optimizer=named_optimizer(a.optimizer),
                      param_dtype=a.param_dtype,
                      stages=a.stages, remat=remat, grad_accum=a.grad_accum,
                      offload=a.offload == "auto", replica=a.replica, bandwidth=a.bandwidth,
                      quantize=quantize, model_parallel=a.model_parallel, margin=a.margin,
                      peak_tflops=a.peak_tflops, device=a.device, efficiency=a.efficiency,
                      name=name, progress=lambda c, phase, i, n: progress(
                          _plan_label(c, a.devices), phase, i, n))
    except ZeroError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    finally:
        seconds = progress.close()
    more = len(result.candidates) - count
    extra = []
    if result.model_searched:
        n = sum(c.model > 1 and not c.offload and not c.zeropp() for c in result.candidates)
        extra.append(f"{n} with a model axis (nothing fit on model = 1)")
        more -= n
    if result.offload_searched:
        n = sum(c.offload is not None and not c.zeropp() for c in result.candidates)
        extra.append(f"{n} with offload (nothing fit without it)")
        more -= n
    if more:
        extra.append(f"{more} ZeRO++ variants of the best that fit")
    print(f"searched {' + '.join([cands, *extra])} in {seconds:.0f} s", file=sys.stderr)
    if a.json:
        print(json.dumps({"model": name, "optimizer": a.optimizer, "assumptions": facts,
                          **result.as_dict()}, indent=1))
        return 0 if result.best else 1
    print_table(title(result), rows(result))
    for note in result.notes():
        print(f"note: {note}")
    print(chosen_line(result), file=sys.stdout if result.best else sys.stderr)
    return 0 if result.best else 1


def _check_links(p: Parser, a) -> None:
    """Usage errors among --bandwidth, --replica, --quantize and --model-parallel (before
    anything compiles)."""
    axes = set(a.bandwidth) - {"model"} if isinstance(a.bandwidth, dict) else set()
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
    per = a.devices // a.replica
    bad = [m for m in a.model_parallel or () if per % m]
    if bad:
        p.error(f"--model-parallel {','.join(map(str, bad))} does not divide the {per} devices "
                f"of a replica; give sizes that divide --devices / --replica")
    if "replica" in axes and a.replica == 1:
        p.error("--bandwidth names a replica link but --replica is 1: give --replica R (the "
                "number of groups, e.g. nodes) or name only data=...")
    want = {"data", "replica"} if a.replica > 1 else {"data"}
    if isinstance(a.bandwidth, dict) and axes != want:
        p.error(f"--bandwidth {','.join(sorted(a.bandwidth))}: with --replica {a.replica} name "
                f"{' and '.join(sorted(want))}, and model if you like (or give one figure for "
                f"every link)")


def _link_facts(a, peak: float, where: str) -> dict[str, str]:
    """The assumptions' lines for --bandwidth / --replica / the compute they are weighed
    against (at `peak` TFLOP/s per device, from `where`)."""
    if a.bandwidth is None:
        return {}

    links = a.bandwidth if isinstance(a.bandwidth, dict) else {"every link": a.bandwidth}
    model = "" if not isinstance(a.bandwidth, dict) or "model" in links else \
        f", model {format_bytes(links['data'])}/s (data's)"
    zeropp = ("hpZ (exact)" if a.replica > 1 else "") if a.quantize == "off" else \
        f"qwZ int8 + qgZ {a.quantize or 'int4'}" + (", hpZ" if a.replica > 1 else "")
    return {"links": ", ".join(f"{axis} {format_bytes(bw)}/s" for axis, bw in links.items())
            + model + (f"; {a.replica} groups of {a.devices // a.replica} devices"
               if a.replica > 1 else ""),
            "compute": f"model FLOPs per device at {100 * a.efficiency:g}% of {peak:g} TFLOP/s "
                       f"({where})" + ("" if a.device or a.peak_tflops else
                                       "; --device or --peak-tflops for another device"),
            "step time": "compute + the link time it does not hide (data and replica "
                         "collectives inside the loops that compute hide behind it; the model "
                         "axis's all-reduces and everything else do not)",
            "zero++": (f"{zeropp} tried on the best that fits per stage"
                       + (" and mesh" if a.replica > 1 else "") if zeropp else "none")
            + "; the shortest step wins, a quantized one only if 5% shorter than the best "
              "exact one"}


def _plan_label(c, devices: int) -> str:
    """A plan candidate in words: its mesh (where it has a replica or model axis), the
    options."""
    mesh = f" on {c.mesh_text(devices)}" if c.replica > 1 or c.model > 1 else ""
    zeropp = f" + {c.zeropp()}" if c.zeropp() else ""
    return _label(c.stage, c.remat, c.grad_accum, c.offload) + mesh + zeropp


def disk_arg(text: str) -> float:
    """A size (e.g. 2TB); a negative one is refused by name (argparse would read it as 0)."""
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"{text!r}: give the disk space per device, more than 0 "
                                         f"bytes, e.g. 2TB")
    return size_arg(text)


def model_parallel_arg(text: str) -> tuple[int, ...] | None:
    """`auto` (None) or model-axis sizes, e.g. `1,2,4`."""
    if text == "auto":
        return None
    try:
        sizes = tuple(sorted({int(t) for t in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give auto or sizes, e.g. 1,2,4") from None
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every model-axis size must be >= 1")
    return sizes


def percent_arg(text: str) -> float:
    """`10%` or `0.1` -> 0.1, in [0, 1)."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a share, e.g. 10% or 0.1") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 0% and below 100%")
    return value


def bandwidth_arg(text: str) -> float | dict[str, float]:
    """`25GB/s` (every link) or `data=400GB/s,replica=25GB/s,model=900GB/s` -> bytes per
    second."""
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
            if axis.strip() not in ("data", "replica", "model"):
                raise ValueError(f"{axis.strip()!r} is not a mesh axis; name data, replica and "
                                 f"model, e.g. data=400GB/s,replica=25GB/s")
            links[axis.strip()] = one(value)
        return links
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
