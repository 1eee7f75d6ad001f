"""The `estimate` command of `python -m zerojax`: the ZeRO paper's formulas per stage for a
parameter count or any GPT shape, with a tensor-parallel model axis (nothing is compiled)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from zerojax.analysis.accounting import (
    ADAM_BYTES,
    MASTER_BYTES,
    comm_estimate,
    estimate,
    format_bytes,
    nvme_ring_bytes,
    pinned_limit,
)
from zerojax.analysis.commands import _shape_args, model_config, quantize_args
from zerojax.analysis.console import (
    Parser,
    non_negative_arg,
    positive_arg,
    print_assumptions,
    print_table,
)
from zerojax.analysis.estimate_args import STAGES, EstimateError
from zerojax.analysis.estimate_table import estimate_table
from zerojax.analysis.planning import named_optimizer
from zerojax.app.presets import OPTIMIZERS
from zerojax.collectives.quantize import bytes_per_element
from zerojax.config import OFFLOAD_DEVICES, OFFLOADS, QUANT_BLOCK


def estimate_main(argv: list[str]) -> int:
    """`python -m zerojax estimate --params 7.5e9 --devices 64 [--json]`, or a GPT shape
    (`--model 1b`, `--layers 24 --d-model 2048 ...`) instead of `--params`."""
    p = Parser(prog="zerojax estimate", description="ZeRO paper memory/comm per device")
    p.add_argument("--params", type=float, default=None,
                   help="parameter count Ψ, e.g. 7.5e9 (or a GPT shape: --model, --layers ...)")
    _shape_args(p, "GPT preset whose Ψ, split params and activations to count")
    p.add_argument("--devices", type=positive_arg, required=True,
                   help="devices in all: replica x data x model")
    p.add_argument("--replica", type=positive_arg, default=1, help="replica groups (hybrid)")
    p.add_argument("--model-parallel", type=positive_arg, default=1,
                   help="M: a tensor-parallel model axis; the split params are divided over "
                        "data x model, the rest over data, and Megatron's all-reduces counted "
                        "(with a shape)")
    p.add_argument("--batch", type=positive_arg, default=None,
                   help="with a shape: global batch in sequences for the activations and the "
                        "model axis's bytes (default: one per data-parallel device)")
    p.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True,
                   help="with a shape: recompute each layer in backward")
    p.add_argument("--param-bytes", type=float, default=2, help="bytes per compute param")
    p.add_argument("--grad-bytes", type=float, default=2, help="bytes per gradient element")
    p.add_argument("--optimizer-bytes", type=float, default=None,
                   help="K: fp32 master + Adam moments per param (default: 12); given, it wins "
                        "over --optimizer")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                   help="K = 4 (fp32 master) + the state this optimizer's init allocates on the "
                        "shape (with --params: the GPT shape nearest it, "
                        "zerojax.analysis.largest.gpt_family); hyperparameters as in zerojax "
                        "train --help")
    p.add_argument("--reduce-bytes", type=float, default=None,
                   help="bytes per reduced gradient element (default: --grad-bytes)")
    p.add_argument("--offload", choices=OFFLOADS, default=None,
                   help="stages 1-3 keep the optimizer bytes in host memory (stage 0 stays "
                        "the baseline); adds host, host peak and host<->device columns")
    p.add_argument("--offload-device", choices=OFFLOAD_DEVICES, default="cpu",
                   help="with --offload: where the offloaded state lives: cpu (host memory) or "
                        "nvme (ZeRO-Infinity: on disk, streamed through a ring of host buffers; "
                        "adds a disk column)")
    p.add_argument("--delayed-update", type=non_negative_arg, default=None, metavar="K",
                   help="with --offload: the delayed parameter update (train --delayed-update "
                        "K): + its pending gradient shard (Ψ/N in the gradient's "
                        "dtype) in host memory and the next compute shard on the device")
    p.add_argument("--offload-fraction", type=float, default=None, metavar="F",
                   help="with --offload: Twin-Flow (train --offload-fraction F): the host keeps "
                        "the share F of the offloaded bytes, the devices the rest")
    quantize_args(p)
    p.add_argument("--hpz", action="store_true",
                   help="ZeRO++ hpZ (stage 3, needs --replica > 1): a secondary param copy "
                        "sharded within each replica")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    a = p.parse_args(argv)
    if a.delayed_update is not None and a.offload is None:
        p.error(f"--delayed-update {a.delayed_update} needs --offload optimizer: the delayed "
                f"update is the offloaded one")
    if a.offload_fraction is not None and (a.offload is None or not 0 < a.offload_fraction <= 1):
        p.error(f"--offload-fraction {a.offload_fraction} needs --offload optimizer and a value "
                f"in (0, 1]: the host's share of the offloaded state")
    if a.offload_device == "nvme" and a.offload is None:
        p.error("--offload-device nvme needs --offload optimizer: the NVMe tier holds the "
                "offloaded master and optimizer state")
    fraction = 1.0 if a.offload_fraction is None else a.offload_fraction
    nvme = a.offload_device == "nvme"
    if a.hpz and a.replica < 2:
        p.error("--hpz needs --replica R > 1: hpZ shards its secondary copy within a replica")
    m = a.model_parallel
    if a.devices % (a.replica * m):
        p.error(f"--devices {a.devices} do not split into --replica {a.replica} x data x "
                f"--model-parallel {m}; give sizes whose product divides --devices")
    name, cfg = model_config(p, a, params_flag=False)
    if a.params is not None and cfg is not None:
        p.error("--params and a GPT shape both give Ψ; drop one of them")
    if a.params is None and cfg is None:
        p.error("the following arguments are required: --params (or a GPT shape: --model, or "
                "--layers --d-model ...)")
    if cfg is None and (a.batch is not None or a.remat is not True):
        p.error("--batch and --no-remat size the activations of a GPT shape; give one "
                "(--model, or --layers --d-model ...) instead of --params")
    groups = a.devices // m  # replica x data
    shape, shape_from = _shape(p, a, cfg)
    psi = _psi(a, cfg)
    split, activations, act_rows = _model_axis(p, a, shape, psi, groups)
    k, source = _optimizer_bytes(p, a, shape, shape_from)
    mem_kw = dict(param_bytes=a.param_bytes, grad_bytes=a.grad_bytes,
                  optimizer_bytes=k, replica=a.replica, model=m, split_params=split)
    comm_kw = dict(param_bytes=a.param_bytes, grad_bytes=a.grad_bytes,
                   reduce_bytes=a.reduce_bytes, replica=a.replica, model=m, split_params=split,
                   activations=activations)
    try:
        rows = estimate_table(psi, a.devices, **mem_kw, reduce_bytes=a.reduce_bytes,
                              offload=a.offload, quantize_weights=a.quantize_weights,
                              quantize_grads=a.quantize_grads, hpz=a.hpz,
                              activations=activations, delayed_update=a.delayed_update,
                              offload_fraction=fraction, offload_device=a.offload_device)
        qw = bytes_per_element(a.quantize_weights, QUANT_BLOCK) if a.quantize_weights else None
        out = [{"stage": s, "offload": a.offload if s else None,
                "memory": estimate(psi, a.devices, s, **mem_kw,
                                   offload=a.offload if s else None, hpz=a.hpz and s == 3,
                                   secondary_bytes=qw,
                                   delayed_update=a.delayed_update if s else None,
                                   offload_fraction=fraction if s else 1.0,
                                   offload_device=a.offload_device if s else "cpu").as_dict(),
                "comm": comm_estimate(psi, a.devices, s, **comm_kw,
                                      quantize_weights=a.quantize_weights if s else None,
                                      quantize_grads=a.quantize_grads,
                                      hpz=a.hpz and s == 3).as_dict()} for s in STAGES]
    except EstimateError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    for row, act in zip(rows, act_rows):
        row.update(act)
    facts = _facts(a, name, psi, split, k, source, activations, shape_from)
    print_assumptions(f"zerojax estimate: {name or f'Ψ = {psi:,}'} on {a.devices} devices",
                      facts)
    if a.json:
        print(json.dumps({"params": psi, "devices": a.devices, "replica": a.replica,
                          "offload_device": a.offload_device if a.offload else None,
                          "model_parallel": m, "split_params": split, "model": name,
                          "optimizer": a.optimizer, "optimizer_bytes": k,
                          "optimizer_bytes_from": source, "assumptions": facts,
                          "stages": out, "activations": act_rows or None}, indent=1))
    else:
        title = f"Ψ = {psi:,} params on {a.devices} devices (per device)"
        if nvme:
            title += ("; total: device bytes, disk: master + optimizer state in the NVMe store "
                      f"(each device's shard), host: the ring of I/O buffers "
                      f"({format_bytes(nvme_ring_bytes())} a device: ZeroConfig's "
                      "nvme_buffer_count x 3 x 4 bytes x nvme_buffer_size), host peak: + the "
                      "gradient shard down and the compute shard up while the update streams")
        elif a.offload:
            title += ("; total: device bytes, host: master + optimizer state in host memory, "
                      "host peak: + the gradient shard down and the compute shard up while "
                      "the update runs in place (in the CPU backend's memory; XLA:GPU's "
                      "pinned-host pool holds the gradient shard on its way: "
                      f"{format_bytes(pinned_limit())} here, XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB)")
        if a.delayed_update is not None:
            title += ("; --delayed-update: host and host peak include the pending gradient "
                      "shard (of which pending), total the next step's compute shard "
                      "beside the one the step runs on")
        if fraction < 1:
            title += (f"; --offload-fraction {fraction:g}: the host keeps that share of the "
                      f"offloaded bytes and of host<->device, the devices update the rest (in "
                      f"optimizer and total)")
        print_table(title, rows)
        if a.optimizer or a.optimizer_bytes is not None:
            print(f"note: K = {k:.4g} bytes per param: {source}")
    return 0


def _shape(p: Parser, a, cfg) -> tuple[Any, str]:
    """The GPT shape the optimizer state and the model axis's split are read from: the one
    given, else (with --params, where they are needed) the family's nearest to Ψ."""
    if cfg is not None:
        return cfg, "the shape given"
    if a.optimizer is None and a.model_parallel == 1:
        return None, ""
    if not a.params > 0:
        p.error(f"--params {a.params:g}: --optimizer and --model-parallel read a GPT shape of "
                f"about that many params; give a positive count")
    from zerojax.analysis.largest import nearest_shape
    from zerojax.models.gpt import GPT

    name, near = nearest_shape(a.params)
    return near, (f"{name} ({GPT(near).num_params() / 1e9:.3g}B params), the GPT shape nearest "
                  f"Ψ")


def _psi(a, cfg) -> int | float:
    if cfg is not None:
        from zerojax.models.gpt import GPT

        return GPT(cfg).num_params()
    return int(a.params) if a.params == int(a.params) else a.params


def _model_axis(p: Parser, a, shape, psi, groups: int):
    """(split params, `Activations` of a step, per-stage activation columns) of the shape
    given (None / [] with --params alone)."""
    from zerojax.analysis.largest import activation_bytes
    from zerojax.analysis.tensor import Activations, split_count
    from zerojax.models.gpt import GPT

    m = a.model_parallel
    split = None
    if shape is not None and m > 1:
        count = split_count(GPT(shape))
        # With --params alone: the nearest shape's share of split params, applied to Ψ.
        split = count if a.params is None else round(psi * count / GPT(shape).num_params())
    if a.params is not None:
        return split, None, []
    batch = a.batch or groups
    if batch % groups:
        p.error(f"--batch {batch} is not divisible by the {groups} data-parallel devices "
                f"(--devices / --model-parallel); use a multiple")
    dtype = {2: "bfloat16", 4: "float32"}.get(int(a.param_bytes), "bfloat16")
    act = activation_bytes(shape, batch // groups, dtype, a.remat, m)
    col = {"activations": _fmt(act["total"])}
    return split, Activations.of(shape, batch * shape.seq_len, groups, a.remat), [col] * 4


def _fmt(v: float) -> str:
    from zerojax.analysis.accounting import format_bytes

    return format_bytes(v)


def _optimizer_bytes(p: Parser, a, shape, shape_from: str) -> tuple[float, str]:
    """`estimate`'s K and where it comes from: --optimizer-bytes, else --optimizer's init on the
    shape (given, or nearest --params), else Adam's 12."""
    if a.optimizer_bytes is not None:
        return a.optimizer_bytes, "--optimizer-bytes"
    if a.optimizer is None:
        return MASTER_BYTES + ADAM_BYTES, "fp32 master + Adam moments"
    from zerojax.analysis.largest import state_per_param

    k = state_per_param(named_optimizer(a.optimizer), shape)
    return MASTER_BYTES + k, f"fp32 master 4 + {a.optimizer} state {k:.4g} read from its init " \
                             f"on {shape_from}"


def _facts(a, name, psi, split, k, source, activations, shape_from) -> dict[str, str]:
    """What the estimate assumes: the shape, the mesh, the dtypes, K and what comm counts."""
    m, r = a.model_parallel, a.replica
    data = a.devices // (r * m)
    mesh = " x ".join(f"{k} {v}" for k, v in (("replica", r), ("data", data), ("model", m))
                      if v > 1 or k == "data")
    facts = {"params": f"Ψ = {psi:,}" + (f" ({name})" if name else ""),
             "mesh": f"{a.devices} devices: {mesh}",
             "bytes": f"params {a.param_bytes:g}, gradients {a.grad_bytes:g}, reduced "
                      f"gradients {a.reduce_bytes or a.grad_bytes:g} per element",
             "K": f"{k:.4g} bytes per param: {source}"}
    if m > 1:
        share = f" (the share of {shape_from}, applied to Ψ)" if a.params is not None else ""
        facts["model axis"] = (f"{split:,} params split over model{share}: they are divided "
                               f"over data x model, the other {psi - split:,} over data only")
    facts["comm"] = ("bytes one device sends per step in ring collectives (all-gather and "
                     "reduce-scatter (N-1)/N of the buffer, all-reduce twice that): ZeRO's "
                     "gathers of params (stage 3: forward and backward, remat) and reductions "
                     "of gradients over data" + (" and replica" if r > 1 else "")
                     + (", each of a device's model piece" if m > 1 else "")
                     + ("; Megatron's all-reduces over model (4 per layer + 1 with remat, of "
                        "the data group's tokens x d, plus the vocabulary-split embedding, head "
                        "and cross-entropy)" if m > 1 and activations else "")
                     + ("; the model axis's all-reduces need a shape (--model, --layers ...) "
                        "and are not counted" if m > 1 and not activations else "")
                     + "; not counted: the loss and norm scalars, latency, overlap")
    if activations is not None:
        facts["activations"] = (f"{a.batch or a.devices // m} sequences per step, "
                                f"{activations.tokens:,.0f} tokens per data-parallel device, "
                                f"remat {'on' if a.remat else 'off'}: Korthikanti et al. 2022 "
                                f"per layer (zerojax.analysis.largest.activation_bytes)")
    return facts
