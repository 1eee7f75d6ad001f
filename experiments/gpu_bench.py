"""The GPU benchmark behind scripts/gpu_bench.sh: MFU, tokens/s and compiled peak memory of
plain optax against zerojax stages 0-3, without and with the XLA overlap flags, and the largest
GPT shape each steps without running out of memory. Writes DIR/gpu_bench.json and
DIR/gpu_bench.md.

Every measurement runs in its own process (experiments/bench.py, or a `--probe` of this
script), so an out-of-memory failure costs one figure, not the run, and the parent never starts
a jax backend (on a GPU that would take the memory the children need). Parts: `bench`, `overlap`
and `largest` each write DIR/<part>.json; the report is rebuilt from whichever are there, so a
part can be rerun alone (`--parts largest`).

    .venv/bin/python experiments/gpu_bench.py --out runs/gpu_bench
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # zerojax from this checkout, as bench.py gets it

from zerojax.analysis.accounting import format_bytes  # noqa: E402 -- no jax backend started
from zerojax.analysis.largest import gpt_family, largest  # noqa: E402
from zerojax.models.gpt import GPT, PRESETS  # noqa: E402

PARTS = ("bench", "overlap", "largest")
PINNED_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"  # XLA:GPU's pinned-host pool, GiB
OFFLOAD = "stage3_offload"  # bench.OFFLOAD: stage 3 with the optimizer state in host memory
OFFLOAD_DPU = "stage3_offload_dpu"  # bench.OFFLOAD_DPU: ... and the delayed parameter update
STAGES = [f"stage{s}" for s in range(4)]
ZEROPP = ["stage3_qwz", "stage3_qgz", "stage3_qwz_qgz", "stage3_zeropp"]  # bench.ZEROPP
TWIN = ["stage3_twin", "stage3_twin_dpu"]  # bench.TWIN, TWIN_DPU: Twin-Flow, bench's fraction
VARIANTS = [*STAGES, OFFLOAD, OFFLOAD_DPU, *ZEROPP, *TWIN]
LABELS = {OFFLOAD: "stage 3 + offload", OFFLOAD_DPU: "stage 3 + offload, delayed update",
          "stage3_twin": "stage 3 + offload, Twin-Flow 0.4 on the host",
          "stage3_twin_dpu": "stage 3 + offload, Twin-Flow 0.4, delayed update",
          "stage3_qwz": "stage 3 + qwZ int8",
          "stage3_qgz": "stage 3 + qgZ int4", "stage3_qwz_qgz": "stage 3 + qwZ + qgZ",
          "stage3_zeropp": "stage 3 + qwZ + qgZ + hpZ (2 × N/2)"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/gpu_bench", help="directory for the results")
    p.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    p.add_argument("--devices", type=int, default=1, help="mesh size N")
    p.add_argument("--batch", type=int, default=None, help="global batch (default 8·N)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps-per-repeat", type=int, default=5)
    p.add_argument("--variants", nargs="+", default=[v for v in VARIANTS if v not in TWIN],
                   choices=VARIANTS,
                   help="zerojax stages to time next to plain optax")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--largest-variants", nargs="+", default=["optax", "stage3", OFFLOAD],
                   choices=["optax", *[v for v in VARIANTS if v not in TWIN]],
                   help="variants whose largest shape is probed")
    p.add_argument("--largest-shapes", nargs="+", default=None,
                   help="shapes to search, smallest first (default: largest.gpt_family(); "
                        "preset names work too)")
    p.add_argument("--largest-batch", type=int, default=None,
                   help="global batch of the largest-shape probes (default: one sequence per "
                        "device)")
    p.add_argument("--memory", type=float, default=None,
                   help="device bytes for the planner's first guess (default: the device's)")
    p.add_argument("--host-memory", type=float, default=None,
                   help="host bytes for the planner's offload guess (default: this machine's "
                        "physical memory)")
    p.add_argument("--pinned-limit-gb", type=int, default=None,
                   help="XLA:GPU's pinned-host pool for the probes, in GiB (sets "
                        "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB; default: that variable if set, "
                        "else 90%% of the host memory: XLA's own default, 64 GiB, holds less "
                        "than offload's host peak of a 7b model)")
    p.add_argument("--update-params", type=float, default=50e6,
                   help="bench part, with stage3_offload: the offloaded AdamW update alone on "
                        "a shard of this many params against a memory copy (0: not)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per child process")
    p.add_argument("--probe", nargs=2, metavar=("SHAPE", "VARIANT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def optax_name(devices: int) -> str:
    """Plain jax + optax: one device without shardings, else GSPMD FSDP."""
    return "optax_single" if devices == 1 else "gspmd_fsdp"


def shapes(args) -> dict:
    family = {**gpt_family(), **PRESETS}
    names = args.largest_shapes or list(gpt_family())
    unknown = [n for n in names if n not in family]
    if unknown:
        raise SystemExit(f"unknown --largest-shapes {unknown}; choose from {sorted(family)}")
    return {n: family[n] for n in names}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def child(cmd: list[str], timeout: int, log_path: Path) -> subprocess.CompletedProcess:
    log(f"$ {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        proc = subprocess.CompletedProcess(cmd, 124, e.stdout or "", f"timed out after {timeout} s")
    with open(log_path, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}\n")
    log(f"  rc {proc.returncode} in {time.perf_counter() - t0:.0f} s")
    return proc


# ---------------------------------------------------------------------------------- parts


def run_bench(args, out: Path, overlap: str) -> bool:
    """One bench.py run; False (and the reason on stderr) if it failed."""
    name = "bench" if overlap == "off" else "overlap"
    base = optax_name(args.devices)
    cmd = [sys.executable, str(HERE / "bench.py"), "--preset", args.preset,
           "--devices", str(args.devices), "--batch", str(args.batch),
           "--repeats", str(args.repeats), "--steps-per-repeat", str(args.steps_per_repeat),
           "--baseline", base, "--variants", base, *args.variants, "--sequential",
           "--overlap", overlap, "--json", str(out / f"{name}.json"),
           "--update-params", str(args.update_params if overlap == "off" else 0)]
    (out / f"{name}.json").unlink(missing_ok=True)  # a failed run leaves no stale figures
    proc = child(cmd, args.timeout, out / f"{name}.log")
    if proc.returncode:
        log(f"{name}: experiments/bench.py failed (rc {proc.returncode}); see "
            f"{out / f'{name}.log'}:\n{proc.stderr[-2000:]}")
    return proc.returncode == 0


def probe(args) -> dict:
    """In this process: build `VARIANT` of shape `SHAPE`, compile it, take two steps."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench", HERE / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = bench  # dataclasses look their module up by name
    spec.loader.exec_module(bench)
    shape, variant = args.probe
    cfg = shapes(argparse.Namespace(largest_shapes=[shape]))[shape]
    bargs = bench.parse_args(["--devices", str(args.devices), "--batch", str(args.batch)])
    bench.setup_backend(bargs)
    import jax
    import numpy as np

    import zerojax as zj
    from zerojax.app.runlog import host_memory

    model = GPT(cfg)
    tokens = np.zeros((args.batch, cfg.seq_len + 1), np.int32)
    host_batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    name = optax_name(args.devices) if variant == "optax" else variant
    out = {"shape": shape, "variant": name, "num_params": model.num_params(),
           "device_kind": jax.devices()[0].device_kind}
    # The process's resident memory (now, and its peak so far) as each phase ends: where the
    # host side of offload (pinned buffers included) grows past its state.
    phases = out["host_rss_phases"] = []

    def mark(what):
        rss = host_memory()
        phases.append([what, rss.get("host_rss_bytes"), rss.get("host_rss_peak_bytes")])

    try:
        make = bench.variant_makers(model, zj.make_mesh(data=args.devices), bargs,
                                    host_batch)[name]

        def made():
            v = make()
            mark("state made")
            return v

        v = bench._prepare(made)
        mark("compiled")
        out.update(v.memory)
        for i in range(2):
            v.state, m = v.step(v.state, v.batch)
            jax.block_until_ready((v.state, m))
            mark(f"step {i + 1}")
        out.update(ok=True, loss=float(np.mean(m["loss"])))
    except Exception as e:  # noqa: BLE001 -- out of memory, mostly: the answer, not a failure
        out.update(ok=False, reason=bench._reason(e))
    # to hold against the host state (target: <= 1.25x)
    out["host_rss_peak_bytes"] = host_memory()["host_rss_peak_bytes"]
    return out


def run_largest(args, out: Path) -> None:
    """Per variant: from the planner's estimate, up while it steps, down while it does not."""
    family = shapes(args)
    names = list(family)
    memory = args.memory or _device_memory(out)
    host = args.host_memory or _host_memory()
    pinned = int(os.environ.get(PINNED_ENV, "64")) << 30  # XLA's default where unset
    batch_per_device = args.largest_batch // args.devices
    results = {}
    for variant in args.largest_variants:
        start = 0
        if memory:
            stage = 0 if variant == "optax" else int(variant[len("stage")])
            offload = "optimizer" if variant == OFFLOAD else None
            row = largest(args.devices, memory, batch_per_device=batch_per_device,
                          stages=(stage,), remat=(True,), family=family, offload=offload,
                          host_memory=host if offload else None,
                          pinned=pinned // args.devices if offload else None)[0]
            start = names.index(row["fits"].name) if row["fits"] else 0
        probes: dict[str, dict] = {}
        i = start
        while 0 <= i < len(names):
            probes[names[i]] = p = _probe(args, out, names[i], variant)
            step = 1 if p["ok"] else -1
            nxt = i + step
            if not 0 <= nxt < len(names) or names[nxt] in probes:
                break
            if p["ok"] is False and i > start:  # going up, and this one failed: done
                break
            i = nxt
        ok = [n for n in names if probes.get(n, {}).get("ok")]
        best = ok[-1] if ok else None
        bigger = [n for n in names if n in probes and not probes[n]["ok"]
                  and (best is None or names.index(n) > names.index(best))]
        results[variant] = {"largest": best, "first_failing": bigger[0] if bigger else None,
                            "estimate_start": names[start], "probes": probes,
                            "top_of_search": best == names[-1],
                            "predicted": row["fits"].name if memory and row["fits"] else None}
    (out / "largest.json").write_text(json.dumps(
        {"devices": args.devices, "batch": args.largest_batch, "memory_for_estimate": memory,
         "host_memory_for_estimate": host, "pinned_limit": pinned, "shapes": names,
         "variants": results}, indent=1))


def _probe(args, out: Path, shape: str, variant: str) -> dict:
    cmd = [sys.executable, str(HERE / "gpu_bench.py"), "--probe", shape, variant,
           "--devices", str(args.devices), "--batch", str(args.largest_batch)]
    proc = child(cmd, args.timeout, out / "largest.log")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
    return {"shape": shape, "variant": variant, "ok": False,
            "reason": f"process exited {proc.returncode}: {tail}"}


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _device_memory(out: Path) -> float | None:
    """The device's memory for the planner's first guess: what XLA's allocator reported to this
    run's bench part, else the GPU's total from `nvidia-smi` times the memory fraction the
    probes run with (`--parts largest` alone; this process never starts a device backend),
    else None (the search starts at the smallest shape)."""
    for part in ("bench", "overlap"):
        path = out / f"{part}.json"
        if path.exists():
            return json.loads(path.read_text())["machine"].get("device_memory_bytes")
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,"
                              "nounits"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    totals = [float(v) for v in smi.stdout.split() if v.replace(".", "", 1).isdigit()]
    if smi.returncode or not totals:
        return None
    return min(totals) * 2**20 * float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))


# ---------------------------------------------------------------------------------- report


def report(out: Path) -> dict:
    """DIR/gpu_bench.json and DIR/gpu_bench.md from the parts' files present."""
    parts = {p: json.loads((out / f"{p}.json").read_text()) for p in PARTS
             if (out / f"{p}.json").exists()}
    result = {"parts": parts}
    (out / "gpu_bench.json").write_text(json.dumps(result, indent=1))
    (out / "gpu_bench.md").write_text(markdown(parts))
    return result


def markdown(parts: dict) -> str:
    lines = ["# zerojax GPU benchmark", ""]
    runs = [parts[p] for p in ("bench", "overlap") if p in parts]
    if runs:
        cfg, m = runs[0]["config"], runs[0]["machine"]
        peak = cfg["peak_flops"]
        lines += [
            f"- device: {m['device_kind']} × {cfg['devices']} ({m['platform']}), memory "
            f"{_size(m['device_memory_bytes'])} each (as XLA's allocator reports it); "
            f"jax {m['jax']}",
            f"- peak: {f'{peak / 1e12:.0f} TFLOP/s dense bf16' if peak else 'unknown (no MFU)'}"
            f" per device, from `zerojax.analysis.flops.PEAK_TFLOPS` by device kind",
            f"- model: {cfg['preset']} ({cfg['num_params']:,} params), global batch "
            f"{cfg['batch']} × {cfg['seq_len']} tokens, {cfg['param_dtype']} compute, float32 "
            f"master and AdamW moments, remat per layer {cfg['remat']}, clip {cfg['clip_norm']}",
            f"- {cfg['flops_formula']}: {cfg['flops_per_token']:,} FLOPs per token",
            f"- timing: {cfg['repeats']} repeats × {cfg['steps_per_repeat']} steps per variant, "
            f"one variant at a time (--sequential), after compile and warm-up; median",
            "- peak memory: the compiled step's `memory_analysis()` (argument + output − "
            f"donated + temp), per device, device memory only (stage 3 + offload keeps the "
            f"float32 master and AdamW moments in pinned host memory: its host bytes are "
            f"shown apart); XLA_PYTHON_CLIENT_MEM_FRACTION="
            f"{m.get('mem_fraction') or '-'}", "",
            "| variant | XLA overlap flags | median ms | tokens/s | MFU | × optax | peak |",
            "|---|---|---:|---:|---:|---:|---:|"]
        for run in runs:
            flags = "on" if run["config"]["overlap"] == "flags" else "off"
            if flags == "on" and not run["config"]["overlap_flags"]:
                flags = "on (no effect: not a GPU)"
            for name, r in run["variants"].items():
                label = LABELS.get(name, name)
                if r["status"] != "ok":
                    lines.append(f"| {label} | {flags} | n/a: {r['reason']} | | | | |")
                    continue
                mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
                lines.append(f"| {label} | {flags} | {r['median_s'] * 1e3:.1f} | "
                             f"{r['tokens_per_s']:,.0f} | {mfu} | {r['ratio']:.3f} | "
                             f"{_peak(r)} |")
        lines.append("")
        update = runs[0].get("offload_update")
        if update:
            lines += ["## The offloaded update alone", "",
                      f"AdamW on a {update['params']:,}-param shard in pinned host memory, "
                      f"{update['bytes_per_update'] / 1e9:.2f} GB read + written per update "
                      f"(experiments/update_bench.py), against np.copyto of the same bytes on "
                      f"this host ({update['cores']} cores), medians of {update['repeats']}:", "",
                      "| what | GB/s | × the best copy | ms |", "|---|---:|---:|---:|"]
            best = max(update["copy_bytes_per_s"].values())
            for name, bw in update["copy_bytes_per_s"].items():
                lines.append(f"| np.copyto, {name} | {bw / 1e9:.2f} | {bw / best:.2f} | |")
            for name, u in update["update"].items():
                lines.append(f"| update, {name} | {u['bytes_per_s'] / 1e9:.2f} | "
                             f"{u['ratio_to_copy']:.2f} | {u['median_s'] * 1e3:.1f} |")
            lines.append("")
    if "largest" in parts:
        lg = parts["largest"]
        lines += ["## Largest GPT that steps", "",
                  f"Batch {lg['batch']} ({lg['batch'] // lg['devices']} per device) on "
                  f"{lg['devices']} device(s); shapes searched from the planner's estimate "
                  f"(`zerojax plan --largest`) up while a shape steps, down while it does not.",
                  f"Offload's host: the planner's host memory "
                  f"{_size(lg.get('host_memory_for_estimate'))}, XLA:GPU's pinned-host pool "
                  f"{_size(lg.get('pinned_limit'))} ({PINNED_ENV}); host RSS peak: the probe "
                  f"process's peak resident memory.",
                  "", "| variant | largest that steps | predicted | params | peak | host RSS peak "
                  "| next larger | why not |", "|---|---|---|---:|---:|---:|---|---|"]
        for variant, r in lg["variants"].items():
            best = r["probes"].get(r["largest"]) if r["largest"] else None
            fail = r["probes"].get(r["first_failing"]) if r["first_failing"] else None
            params = f"{best['num_params']:,}" if best else "-"
            top = " (the largest searched)" if r["top_of_search"] else ""
            rss = _size(best.get("host_rss_peak_bytes")) if best else "-"
            lines.append(f"| {LABELS.get(variant, variant)} | {r['largest'] or 'none'}{top} | "
                         f"{r.get('predicted') or '-'} | {params} | "
                         f"{_peak(best) if best else '-'} | {rss} | "
                         f"{r['first_failing'] or '-'} | {fail['reason'] if fail else '-'} |")
        lines.append("")
        for variant, r in lg["variants"].items():
            best = r["probes"].get(r["largest"]) if r["largest"] else None
            if best and best.get("host_rss_phases"):
                lines += [f"{LABELS.get(variant, variant)}, {r['largest']}: the probe's resident "
                          f"host memory (its peak so far) as each phase ended: " + ", ".join(
                              f"{what} {_size(rss)} ({_size(peak)})"
                              for what, rss, peak in best["host_rss_phases"]), ""]
    rows = targets(parts)
    if any(met is not None for _, _, met in rows):
        lines += ["## Offload's targets", "", "| target | measured | met |", "|---|---|---|"]
        lines += [f"| {t} | {m} | {'-' if met is None else 'yes' if met else 'no'} |"
                  for t, m, met in rows]
        lines.append("")
    return "\n".join(lines)


# Offload's targets on one GPU at the 1b preset (docs/performance.md, "GPU: one H100"): its step
# and its delayed step against plain optax's, its compiled host peak against its host state,
# and the largest GPT it steps against the planner's prediction and the 7b shape.
STEP_LIMITS = ((OFFLOAD, 2.5, "offload's step"), (OFFLOAD_DPU, 1.5, "offload's delayed step"))
HOST_PEAK_LIMIT = 1.25
LARGEST_AT_LEAST = "7b"


def targets(parts: dict) -> list[tuple[str, str, bool | None]]:
    """(target, what the parts measured, met: None where they did not measure it) for each of
    offload's targets."""
    bench = parts.get("bench") or {}
    variants, base = bench.get("variants", {}), bench.get("baseline")
    ok = {n: r for n, r in variants.items() if r.get("status") == "ok"}
    rows = []
    for name, limit, what in STEP_LIMITS:
        x = ok[name]["ratio"] if name in ok else None
        rows.append((f"{what} ≤ {limit}× {base or 'the baseline'}'s",
                     "not measured" if x is None else f"{x:.2f}×",
                     None if x is None else x <= limit))
    peaks = [(r["host_peak_bytes"] / r["host_state_bytes"], LABELS.get(n, n))
             for n, r in ok.items() if r.get("host_peak_bytes") and r.get("host_state_bytes")]
    worst = max(peaks, default=None)
    rows.append((f"host peak ≤ {HOST_PEAK_LIMIT}× the host state (compiled; the largest of "
                 f"the offloaded variants)",
                 "not measured" if worst is None else f"{worst[0]:.2f}× ({worst[1]})",
                 None if worst is None else worst[0] <= HOST_PEAK_LIMIT))
    lg = (parts.get("largest") or {}).get("variants", {}).get(OFFLOAD)
    names = (parts.get("largest") or {}).get("shapes", [])
    target = f"the largest GPT that steps with offload ≥ {LARGEST_AT_LEAST}, as predicted"
    if lg is None or LARGEST_AT_LEAST not in names:
        rows.append((target, "not measured" if lg is None else
                     f"{lg['largest']} ({LARGEST_AT_LEAST} not searched)", None))
    else:
        best = lg["largest"]
        met = (best is not None and names.index(best) >= names.index(LARGEST_AT_LEAST)
               and lg.get("predicted") == best)
        rows.append((target, f"{best or 'none'} (predicted {lg.get('predicted') or '-'})",
                     met))
    return rows


def _size(nbytes) -> str:
    return "-" if nbytes is None else format_bytes(nbytes)


def _peak(r: dict) -> str:
    """The device peak, and the host state beside it where there is one ("derived": the
    backend reports no host bytes, so the state's memory kinds split them); where the compiler
    reports host bytes, the compiled host peak and its ratio to the host state (in place:
    about 1 + the gradient and compute shards' share; the target is <= 1.25)."""
    text = _size(r.get("device_peak_bytes", r.get("peak_bytes")))
    if r.get("host_state_bytes"):
        derived = ", derived" if r.get("split") == "derived" else ""
        text += f" (+ {_size(r['host_state_bytes'])} host{derived}"
        if r.get("host_peak_bytes"):
            text += (f"; host peak {_size(r['host_peak_bytes'])}, "
                     f"{r['host_peak_bytes'] / r['host_state_bytes']:.2f}× the state")
        if r.get("host_update"):  # the fused pass, or the program and why
            text += f"; host update {r['host_update']}"
        text += ")"
    return text


def main(argv=None) -> int:
    args = parse_args(argv)
    args.batch = args.batch or 8 * args.devices
    args.largest_batch = args.largest_batch or args.devices
    if args.batch % args.devices or args.largest_batch % args.devices:
        raise SystemExit(f"--batch {args.batch} and --largest-batch {args.largest_batch} must "
                         f"be multiples of --devices {args.devices}")
    # XLA:GPU preallocates 75% of the device by default; the figures should see nearly all.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    if args.pinned_limit_gb:
        os.environ[PINNED_ENV] = str(args.pinned_limit_gb)
    os.environ.setdefault(PINNED_ENV, str(int(0.9 * _host_memory()) >> 30))
    if args.probe:
        print(json.dumps(probe(args)), flush=True)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = [part for part, overlap in (("bench", "off"), ("overlap", "flags"))
              if part in args.parts and not run_bench(args, out, overlap)]
    if "largest" in args.parts:
        run_largest(args, out)
    report(out)
    print((out / "gpu_bench.md").read_text())
    log(f"wrote {out / 'gpu_bench.json'} and {out / 'gpu_bench.md'}")
    if failed:
        log(f"failed: {', '.join(failed)} (see the .log files in {out})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
