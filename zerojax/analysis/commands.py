"""The `measure` command of `python -m zerojax` (`estimate`: estimate_command.py, `plan`:
plan_command.py), and what the three share: the model's shape from the command line, the
simulated devices, the assumptions block.

`measure` and `plan` simulate devices on the CPU backend, whose device count is fixed when jax
starts its backend: the commands set XLA_FLAGS first, so they must run before anything in the
process has touched jax devices (as `python -m zerojax ...` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

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
from zerojax.app.presets import OPTIMIZERS
from zerojax.config import OFFLOADS


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


def _gpt_and_batch(cfg, batch: int):
    """The GPT of `cfg` (a `GPTConfig`, or a preset's name) and an abstract batch of `batch`
    sequences of its context length."""
    import jax
    import jax.numpy as jnp

    from zerojax.models.gpt import GPT

    model = GPT.from_preset(cfg) if isinstance(cfg, str) else GPT(cfg)
    shape = (batch, model.cfg.seq_len)
    return model, {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("inputs", "targets")}


SHAPE_FLAGS = {"layers": "n_layers", "d_model": "d_model", "heads": "n_heads",
               "vocab": "vocab_size", "seq_len": "seq_len", "d_ff": "d_ff"}


def _shape_args(p: Parser, what: str = "GPT preset") -> None:
    """--model PRESET, or any GPT shape: --layers --d-model --heads --vocab --seq-len --d-ff
    (over the preset's, or alone), or --params (the nearest shape of largest.gpt_family)."""
    from zerojax.models.gpt import PRESETS

    p.add_argument("--model", choices=sorted(PRESETS), default=None, help=what)
    g = p.add_argument_group("any GPT shape (instead of or over --model)")
    g.add_argument("--layers", type=positive_arg, default=None, help="layers L")
    g.add_argument("--d-model", type=positive_arg, default=None, help="width d")
    g.add_argument("--heads", type=positive_arg, default=None,
                   help="attention heads (default: d/64, at least 1)")
    g.add_argument("--vocab", type=positive_arg, default=None,
                   help="vocabulary (default: the preset's, else 32000)")
    g.add_argument("--seq-len", type=positive_arg, default=None,
                   help="context length T (default: the preset's, else 2048)")
    g.add_argument("--d-ff", type=positive_arg, default=None, help="MLP width (default: 4d)")


def _shape_given(a) -> bool:
    return any(getattr(a, k, None) is not None for k in SHAPE_FLAGS)


def model_config(p: Parser, a, params_flag: bool = True):
    """`(name, GPTConfig)` from --model and the shape flags (or --params, where `params_flag`),
    or `(None, None)` where none is given; a bad shape exits 2 with one line."""
    import dataclasses

    from zerojax.models.gpt import PRESETS, GPTConfig

    params = getattr(a, "params", None) if params_flag else None
    if params is not None and (a.model or _shape_given(a)):
        p.error("--params chooses the nearest GPT shape itself; drop --model and the shape "
                "flags, or --params")
    if params is not None:
        if not params > 0:
            p.error(f"--params {params:g}: give a positive parameter count, e.g. 1.3e9")
        from zerojax.analysis.largest import gpt_family, nearest_shape
        from zerojax.models.gpt import GPT

        name, cfg = nearest_shape(params, gpt_family(a.vocab or 32000, a.seq_len or 2048))
        return f"{name} ({GPT(cfg).num_params() / 1e9:.3g}B params, the shape nearest " \
               f"--params {params:g})", cfg
    given = {f: getattr(a, k) for k, f in SHAPE_FLAGS.items() if getattr(a, k) is not None}
    if a.model is None and not given:
        return None, None
    if a.model is None and not {"n_layers", "d_model"} <= set(given):
        p.error("a GPT shape needs --layers and --d-model (the rest have defaults), or a "
                "--model preset to change")
    if a.model is not None:
        base = dataclasses.asdict(PRESETS[a.model])
        if "d_model" in given and "d_ff" not in given:
            base["d_ff"] = 4 * given["d_model"]
        if "d_model" in given and "n_heads" not in given:
            base["n_heads"] = max(1, given["d_model"] // 64)
    else:
        d = given["d_model"]
        base = {"vocab_size": 32000, "seq_len": 2048, "n_heads": max(1, d // 64),
                "d_ff": 4 * d}
    try:
        cfg = GPTConfig(**{**base, **given})
    except ValueError as e:
        p.error(f"{e}; choose --heads that divides --d-model")
    flags = " ".join(f"--{k.replace('_', '-')} {getattr(a, k)}" for k in SHAPE_FLAGS
                     if getattr(a, k) is not None)
    name = a.model if not flags else (f"{a.model} with {flags}" if a.model else
                                      f"GPT ({cfg.n_layers} layers, d={cfg.d_model})")
    return name, cfg


def quantize_args(p: Parser) -> None:
    """ZeRO++'s quantized collectives, as `measure` and `estimate` take them."""
    p.add_argument("--quantize-weights", choices=("int8",), default=None,
                   help="ZeRO++ qwZ: int8 weight gathers (stages 1-3)")
    p.add_argument("--quantize-grads", choices=("int8", "int4"), default=None,
                   help="ZeRO++ qgZ: quantized gradient reductions")


def _model_args(p: Parser, model_required: bool = True) -> None:
    _shape_args(p, "GPT preset" + (" (or a shape below, or --params)" if model_required else
                                   " (or a shape below, or --params; or --largest)"))
    p.add_argument("--params", type=float, default=None,
                   help="instead of a shape: the GPT shape of about this many params nearest "
                        "in largest.gpt_family (e.g. 1.3e9)")
    p.add_argument("--devices", type=positive_arg, required=True,
                   help="devices in all (replica x data x model)")
    p.add_argument("--batch", type=positive_arg, default=None,
                   help="global batch in sequences (default: data-parallel devices x the "
                        "largest grad_accum)")
    p.add_argument("--param-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="compute dtype of params and gradients (master and moments: float32)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="whose state to count (from its init); hyperparameters as in zerojax "
                        "train --help")
    p.add_argument("--json", action="store_true", help="JSON on stdout instead of a table")


def _assumptions(a, name: str, model, batch, groups: int | None = None,
                 **extra: str) -> dict[str, str]:
    """What a measure/plan run assumes, to print before it starts and to keep in its JSON;
    `groups`: the data-parallel devices the batch is split over (default: every device)."""
    import jax

    c, dtype = model.cfg, a.param_dtype
    b, n = batch["inputs"].shape[0], groups or a.devices
    accum = a.grad_accum if isinstance(a.grad_accum, tuple) else (a.grad_accum,)
    micro = ", ".join(f"{b // n // k}" for k in accum if b % (n * k) == 0)
    per = f"{b // n} per data-parallel device" if n != a.devices else f"{b // n} per device"
    master = ("the float32 params themselves in stages 0 and 3; a float32 shard next to the "
              "replicated params in stages 1-2") if dtype == "float32" else "float32"
    return {
        "model": f"{name}: {model.num_params():,} params ({c.n_layers} layers, d={c.d_model}, "
                 f"{c.n_heads} heads, d_ff {c.d_ff}, vocab {c.vocab_size})",
        "devices": f"{a.devices} {jax.devices()[0].platform} devices (the step is compiled "
                   f"for abstract inputs: nothing is allocated)",
        "global batch": f"{b} sequences x {c.seq_len} tokens ({per}); "
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

    from zerojax.analysis.measurement import state_size
    from zerojax.app.presets import STATE, TITLE

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
    p.add_argument("--offload-fraction", type=float, default=None, metavar="F",
                   help="with --offload: the host's share of the state (Twin-Flow; the devices "
                        "keep the rest, counted in the device peak)")
    quantize_args(p)
    p.add_argument("--replica", type=positive_arg, default=1,
                   help="the make_mesh(replica=R, data=devices/R) mesh; the table splits the "
                        "bytes sent over data and over replica")
    p.add_argument("--model-parallel", type=positive_arg, default=1,
                   help="M: a tensor-parallel model axis, mesh replica x data x model (M "
                        "innermost); the table adds the bytes sent over model and their formula")
    p.add_argument("--hpz", action="store_true",
                   help="ZeRO++ hpZ (stage 3, --replica > 1): backward gathers within data")
    a = p.parse_args(argv)
    if a.offload_fraction is not None and (a.offload is None or not 0 < a.offload_fraction <= 1):
        p.error(f"--offload-fraction {a.offload_fraction} needs --offload optimizer and a value "
                f"in (0, 1]: the host's share of the state")
    name, shape = model_config(p, a)
    if shape is None:
        p.error("the following arguments are required: --model (or a shape: --layers "
                "--d-model ..., or --params)")
    m = a.model_parallel
    if a.devices % a.replica:
        p.error(f"--devices {a.devices} do not split into --replica {a.replica} groups; give "
                f"a --replica that divides --devices")
    if a.devices % (a.replica * m):
        p.error(f"--devices {a.devices} do not split into --replica {a.replica} x data x "
                f"--model-parallel {m}; give sizes whose product divides --devices")
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
    import jax

    from zerojax.analysis.measure_report import row, title
    from zerojax.analysis.measurement import activations_of, lower, measure_lowered
    from zerojax.config import ZeroConfig
    from zerojax.engine import Engine
    from zerojax.errors import ZeroError
    from zerojax.mesh import make_mesh

    data = a.devices // (a.replica * m)
    model, batch = _gpt_and_batch(shape, a.batch or a.replica * data * a.grad_accum)
    mesh_words = ", mesh " + " x ".join(f"{k} {v}" for k, v in (
        ("replica", a.replica), ("data", data), ("model", m)) if v > 1 or k == "data")
    facts = _assumptions(a, name, model, batch, a.replica * data, measured=(
        f"stages {','.join(map(str, a.stage))}, remat {'on' if a.remat else 'off'}, "
        f"grad_accum {a.grad_accum}" + (f", offload {a.offload}" if a.offload else "")
        + (f" (Twin-Flow: {a.offload_fraction} on the host)" if a.offload_fraction else "")
        + "".join(f", {k.replace('_', ' ')} {v}" for k, v in quant.items() if v)
        + (", hpZ" if a.hpz else "") + (mesh_words if a.replica > 1 or m > 1 else "")))
    print_assumptions(f"zerojax measure: {name} on {a.devices} devices", facts)
    results, progress = [], Progress(len(a.stage))
    for i, stage in enumerate(a.stage, 1):
        cfg = ZeroConfig(stage=stage, param_dtype=a.param_dtype, remat=a.remat,
                         grad_accum=a.grad_accum, offload=a.offload, hpz=a.hpz,
                         offload_fraction=a.offload_fraction or 1.0, **quant)
        label = _label(stage, a.remat, a.grad_accum, a.offload)
        try:
            mesh = make_mesh(replica=a.replica, data=data, model=m,
                             devices=jax.devices()[:a.replica * data * m])
            engine = Engine(model, named_optimizer(a.optimizer), mesh, cfg)
            progress(label, "lowering", i)
            lowered = lower(engine, batch)
            progress(label, "compiling", i)
            results.append(dataclasses.replace(measure_lowered(engine, lowered),
                                               activations=activations_of(engine, batch)))
            progress(label, "done", i)
        except ZeroError as e:
            progress.close()
            p.exit(2, f"{p.prog}: error: {e}\n")
    progress.close()
    if a.json:
        out = []
        for r in results:
            mem, comm = r.estimates()
            out.append({**r.as_dict(), "estimate": {"memory": mem.as_dict(),
                                                    "comm": comm.as_dict()}})
        print(json.dumps({"model": name, "devices": a.devices, "memory": a.memory,
                          "optimizer": a.optimizer, "assumptions": facts,
                          "measurements": out}, indent=1))
        return 0
    print_table(title(results[0], name, a.optimizer),
                [row(r, memory=a.memory) for r in results])
    return 0
