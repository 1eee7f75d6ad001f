"""The `estimate` and `measure` commands of `python -m zerojax` (`plan`: plan_command.py), and
what the three share.

`measure` and `plan` simulate devices on the CPU backend, whose device count is fixed when jax
starts its backend: the commands set XLA_FLAGS first, so they must run before anything in the
process has touched jax devices (as `python -m zerojax ...` does).
"""

from __future__ import annotations

import argparse
import json
import os
import re

from zerojax.analysis.accounting import (
    ADAM_BYTES,
    MASTER_BYTES,
    STAGES,
    EstimateError,
    comm_estimate,
    estimate,
    estimate_table,
    format_bytes,
)
from zerojax.analysis.console import (
    Parser,
    Progress,
    positive_arg,
    print_assumptions,
    print_table,
    size_arg,
    stages_arg,
)
from zerojax.analysis.planning import LR, named_optimizer
from zerojax.collectives.quantize import bytes_per_element
from zerojax.config import OFFLOADS, QUANT_BLOCK
from zerojax.update.presets import OPTIMIZERS


def estimate_main(argv: list[str]) -> int:
    """`python -m zerojax estimate --params 7.5e9 --devices 64 [--json]`."""
    p = Parser(prog="zerojax estimate", description="ZeRO paper memory/comm per device")
    p.add_argument("--params", type=float, required=True, help="parameter count Ψ, e.g. 7.5e9")
    p.add_argument("--devices", type=positive_arg, required=True, help="data-parallel devices N")
    p.add_argument("--replica", type=positive_arg, default=1, help="replica groups (hybrid)")
    p.add_argument("--param-bytes", type=float, default=2, help="bytes per compute param")
    p.add_argument("--grad-bytes", type=float, default=2, help="bytes per gradient element")
    p.add_argument("--optimizer-bytes", type=float, default=None,
                   help="K: fp32 master + Adam moments per param (default: 12); given, it wins "
                        "over --optimizer")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                   help="K = 4 (fp32 master) + the state this optimizer's init allocates on the "
                        "GPT shape nearest --params (zerojax.analysis.largest.gpt_family); "
                        "hyperparameters as in zerojax train --help")
    p.add_argument("--reduce-bytes", type=float, default=None,
                   help="bytes per reduced gradient element (default: --grad-bytes)")
    p.add_argument("--offload", choices=OFFLOADS, default=None,
                   help="stages 1-3 keep the optimizer bytes in host memory (stage 0 stays "
                        "the baseline); adds host and host<->device columns")
    p.add_argument("--quantize-weights", choices=("int8",), default=None,
                   help="ZeRO++ qwZ: int8 weight gathers (stages 1-3)")
    p.add_argument("--quantize-grads", choices=("int8", "int4"), default=None,
                   help="ZeRO++ qgZ: quantized gradient reductions")
    p.add_argument("--hpz", action="store_true",
                   help="ZeRO++ hpZ (stage 3, needs --replica > 1): a secondary param copy "
                        "sharded within each replica")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    a = p.parse_args(argv)
    if a.hpz and a.replica < 2:
        p.error("--hpz needs --replica R > 1: hpZ shards its secondary copy within a replica")
    psi = int(a.params) if a.params == int(a.params) else a.params
    k, source = _optimizer_bytes(p, a)
    mem_kw = dict(param_bytes=a.param_bytes, grad_bytes=a.grad_bytes,
                  optimizer_bytes=k, replica=a.replica)
    comm_kw = dict(param_bytes=a.param_bytes, grad_bytes=a.grad_bytes,
                   reduce_bytes=a.reduce_bytes, replica=a.replica)
    try:
        rows = estimate_table(psi, a.devices, **mem_kw, reduce_bytes=a.reduce_bytes,
                              offload=a.offload, quantize_weights=a.quantize_weights,
                              quantize_grads=a.quantize_grads, hpz=a.hpz)
        qw = bytes_per_element(a.quantize_weights, QUANT_BLOCK) if a.quantize_weights else None
        out = [{"stage": s, "offload": a.offload if s else None,
                "memory": estimate(psi, a.devices, s, **mem_kw,
                                   offload=a.offload if s else None, hpz=a.hpz and s == 3,
                                   secondary_bytes=qw).as_dict(),
                "comm": comm_estimate(psi, a.devices, s, **comm_kw,
                                      quantize_weights=a.quantize_weights if s else None,
                                      quantize_grads=a.quantize_grads,
                                      hpz=a.hpz and s == 3).as_dict()} for s in STAGES]
    except EstimateError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    if a.json:
        print(json.dumps({"params": psi, "devices": a.devices, "optimizer": a.optimizer,
                          "optimizer_bytes": k, "optimizer_bytes_from": source, "stages": out},
                         indent=1))
    else:
        title = f"Ψ = {psi:,} params on {a.devices} devices (per device)"
        if a.offload:
            title += "; total: device bytes, host: master + optimizer state in host memory"
        print_table(title, rows)
        if a.optimizer or a.optimizer_bytes is not None:
            print(f"note: K = {k:.4g} bytes per param: {source}")
    return 0


def _optimizer_bytes(p: Parser, a) -> tuple[float, str]:
    """`estimate`'s K and where it comes from: --optimizer-bytes, else --optimizer's init on the
    GPT shape nearest --params, else Adam's 12."""
    if a.optimizer_bytes is not None:
        return a.optimizer_bytes, "--optimizer-bytes"
    if a.optimizer is None:
        return MASTER_BYTES + ADAM_BYTES, "fp32 master + Adam moments"
    if not a.params > 0:
        p.error(f"--params {a.params:g}: --optimizer reads K from a GPT shape of about that "
                f"many params; give a positive count")
    from zerojax.analysis.largest import nearest_shape, state_per_param
    from zerojax.models.gpt import GPT

    name, cfg = nearest_shape(a.params)
    k = state_per_param(named_optimizer(a.optimizer), cfg)
    return MASTER_BYTES + k, (f"fp32 master 4 + {a.optimizer} state {k:.4g} read from its init "
                              f"on {name} ({GPT(cfg).num_params() / 1e9:.3g}B params), the "
                              f"GPT shape nearest Ψ")


def _start_devices(p: Parser, devices: int) -> None:
    """Simulates `devices` CPU devices; must run before the process touches a jax device."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                   os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if len(jax.devices()) < devices:
        p.exit(2, f"{p.prog}: error: jax started with {len(jax.devices())} devices before "
                  f"--devices {devices} could be set; run it in a fresh process\n")


def _gpt_and_batch(preset: str, batch: int):
    import jax
    import jax.numpy as jnp

    from zerojax.models.gpt import GPT

    model = GPT.from_preset(preset)
    shape = (batch, model.cfg.seq_len)
    return model, {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("inputs", "targets")}


def _model_args(p: Parser, model_required: bool = True) -> None:
    from zerojax.models.gpt import PRESETS

    p.add_argument("--model", required=model_required, choices=sorted(PRESETS),
                   help="GPT preset" + ("" if model_required else " (required unless --largest)"))
    p.add_argument("--devices", type=positive_arg, required=True, help="data-parallel devices")
    p.add_argument("--batch", type=positive_arg, default=None,
                   help="global batch in sequences (default: devices x the largest grad_accum)")
    p.add_argument("--param-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="compute dtype of params and gradients (master and moments: float32)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="whose state to count (from its init); hyperparameters as in zerojax "
                        "train --help")
    p.add_argument("--json", action="store_true", help="JSON on stdout instead of a table")


def _assumptions(a, model, batch, **extra: str) -> dict[str, str]:
    """What a measure/plan run assumes, to print before it starts and to keep in its JSON."""
    import jax

    c, dtype = model.cfg, a.param_dtype
    b = batch["inputs"].shape[0]
    accum = a.grad_accum if isinstance(a.grad_accum, tuple) else (a.grad_accum,)
    micro = ", ".join(f"{b // a.devices // k}" for k in accum if b % (a.devices * k) == 0)
    master = ("the float32 params themselves in stages 0 and 3; a float32 shard next to the "
              "replicated params in stages 1-2") if dtype == "float32" else "float32"
    return {
        "model": f"{a.model}: {model.num_params():,} params ({c.n_layers} layers, d={c.d_model}, "
                 f"vocab {c.vocab_size})",
        "devices": f"{a.devices} {jax.devices()[0].platform} devices (the step is compiled "
                   f"for abstract inputs: nothing is allocated)",
        "global batch": f"{b} sequences x {c.seq_len} tokens ({b // a.devices} per device); "
                        f"per-device micro-batch {micro or '-'} for grad_accum "
                        f"{', '.join(map(str, accum))}",
        "sequence length": str(c.seq_len),
        "params and grads": f"{dtype} (gradients reduced in {dtype})",
        "master params": master,
        "optimizer": _optimizer_fact(a.optimizer, model),
        **extra,
    }


def _optimizer_fact(name: str, model) -> str:
    """The optimizer line of the assumptions: its state per param, read from its init."""
    if name == "adamw":
        return f"AdamW (lr {LR:g}), moments in float32"
    import jax

    from zerojax.update.presets import STATE, TITLE, state_size

    params = jax.eval_shape(model.init, jax.random.key(0))
    k = state_size(named_optimizer(name), params).per_param
    return (f"{TITLE[name]} (lr {LR:g}), {STATE[name]} in float32: {k:.4g} bytes per param "
            f"(read from its init; AdamW: 8)")


def _label(stage: int, remat: bool, accum: int, offload: str | None = None) -> str:
    return (f"stage {stage}{' + offload' if offload else ''}, remat {'on' if remat else 'off'}, "
            f"accum {accum}")


def measure_main(argv: list[str]) -> int:
    """`python -m zerojax measure --model 7b --devices 64 --stage all [--json]`."""
    p = Parser(prog="zerojax measure", description="memory/comm of compiled steps")
    _model_args(p)
    p.add_argument("--stage", default="all", type=stages_arg, help="all, one stage, or e.g. 0,3")
    p.add_argument("--grad-accum", type=positive_arg, default=1, help="micro-batches per step")
    p.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True,
                   help="recompute each layer in backward")
    p.add_argument("--memory", type=size_arg, default=None, help="mark what fits, e.g. 80GB")
    p.add_argument("--offload", choices=OFFLOADS, default=None,
                   help="keep the optimizer state in host memory (stages 1-3); the table "
                        "splits device and host bytes")
    p.add_argument("--quantize-weights", choices=("int8",), default=None,
                   help="ZeRO++ qwZ: int8 weight gathers (stages 1-3)")
    p.add_argument("--quantize-grads", choices=("int8", "int4"), default=None,
                   help="ZeRO++ qgZ: quantized gradient reductions")
    p.add_argument("--replica", type=positive_arg, default=1,
                   help="the make_mesh(replica=R, data=devices/R) mesh; the table splits the "
                        "bytes sent over data and over replica")
    p.add_argument("--hpz", action="store_true",
                   help="ZeRO++ hpZ (stage 3, --replica > 1): backward gathers within data")
    a = p.parse_args(argv)
    if a.devices % a.replica:
        p.error(f"--devices {a.devices} do not split into --replica {a.replica} groups; give "
                f"a --replica that divides --devices")
    if a.hpz and (a.stage != (3,) or a.replica < 2):
        p.error(f"--hpz needs --stage 3 and --replica R > 1 (got --stage "
                f"{','.join(map(str, a.stage))}, --replica {a.replica})")
    if a.offload and 0 in a.stage:
        p.error(f"--offload {a.offload} needs stages 1-3; drop stage 0 (e.g. --stage 1,2,3)")
    if a.quantize_weights and 0 in a.stage:
        p.error(f"--quantize-weights {a.quantize_weights} needs stages 1-3 (stage 0 gathers no "
                f"params); drop stage 0 (e.g. --stage 1,2,3)")
    quant = {"quantize_weights": a.quantize_weights, "quantize_grads": a.quantize_grads}
    _start_devices(p, a.devices)
    from zerojax.analysis.measurement import lower, measure_lowered
    from zerojax.config import ZeroConfig
    from zerojax.engine import Engine
    from zerojax.errors import ZeroError
    from zerojax.mesh import make_mesh

    model, batch = _gpt_and_batch(a.model, a.batch or a.devices * a.grad_accum)
    facts = _assumptions(a, model, batch, measured=(
        f"stages {','.join(map(str, a.stage))}, remat {'on' if a.remat else 'off'}, "
        f"grad_accum {a.grad_accum}" + (f", offload {a.offload}" if a.offload else "")
        + "".join(f", {k.replace('_', ' ')} {v}" for k, v in quant.items() if v)
        + (", hpZ" if a.hpz else "")
        + (f", mesh replica {a.replica} x data {a.devices // a.replica}" if a.replica > 1
           else "")))
    print_assumptions(f"zerojax measure: {a.model} on {a.devices} devices", facts)
    results, progress = [], Progress(len(a.stage))
    for i, stage in enumerate(a.stage, 1):
        cfg = ZeroConfig(stage=stage, param_dtype=a.param_dtype, remat=a.remat,
                         grad_accum=a.grad_accum, offload=a.offload, hpz=a.hpz, **quant)
        label = _label(stage, a.remat, a.grad_accum, a.offload)
        try:
            mesh = make_mesh(replica=a.replica, data=a.devices // a.replica)
            engine = Engine(model, named_optimizer(a.optimizer), mesh, cfg)
            progress(label, "lowering", i)
            lowered = lower(engine, batch)
            progress(label, "compiling", i)
            results.append(measure_lowered(engine, lowered))
            progress(label, "done", i)
        except ZeroError as e:
            progress.close()
            p.exit(2, f"{p.prog}: error: {e}\n")
    progress.close()
    if a.json:
        out = []
        for m in results:
            mem, comm = m.estimates()
            out.append({**m.as_dict(), "estimate": {"memory": mem.as_dict(),
                                                    "comm": comm.as_dict()}})
        print(json.dumps({"model": a.model, "devices": a.devices, "memory": a.memory,
                          "optimizer": a.optimizer, "assumptions": facts,
                          "measurements": out}, indent=1))
        return 0
    rows = []
    for m in results:
        mem, comm = m.estimates()
        row = {"stage": m.stage, "state": format_bytes(m.state["total"]),
               "state formula": format_bytes(mem.state + mem.host),
               "master+opt": format_bytes(m.state["master"] + m.state["optimizer"]),
               "master+opt formula": format_bytes(mem.optimizer + mem.host),
               "temp": format_bytes(m.temp_bytes), "peak": format_bytes(m.peak_bytes),
               "sent": format_bytes(m.collective_bytes["total"]),
               "sent formula": format_bytes(comm.total),
               "sent compiled": format_bytes(m.collective_bytes_compiled["total"])}
        if a.offload:
            row.update({"device state": format_bytes(m.state["device"]),
                        "host state": format_bytes(m.state["host"]),
                        "host formula": format_bytes(mem.host),
                        "device peak": format_bytes(m.device_peak_bytes), "split": m.split})
        if a.quantize_weights or a.quantize_grads:  # the float32 block scales within "sent"
            row["of which scales"] = format_bytes(sum(
                by.get("f32", 0.0) for kind, by in m.collective_dtype_bytes.items()
                if kind in ("all_gather", "all_to_all")))
        if a.replica > 1:  # what each link carries (across both: a collective over all)
            row.update({f"over {axis}": format_bytes(m.collective_axis_bytes.get(axis, 0.0))
                        for axis in ("data", "replica", "all")})
        if a.memory:
            row["fits"] = "yes" if m.device_peak_bytes <= a.memory else "no"
        rows.append(row)
    n = results[0].num_params if results else 0
    print_table(f"{a.model} ({n:,} params), {a.devices} devices, {a.optimizer}, per device; "
                f"master+opt: the fp32 master and the optimizer state; state formula "
                 f"excludes grads (they live in temp; so does hpZ's secondary copy); sent: "
                 f"bytes per step in "
                 f"{a.param_dtype}"
                 + (" (quantized collectives: their integer values + float32 scales)"
                    if a.quantize_weights or a.quantize_grads else "")
                 + ", compiled: as this backend sends them"
                 + ("; split: device/host peak measured by the compiler or derived from the "
                    "state's memory kinds" if a.offload else ""), rows)
    return 0
