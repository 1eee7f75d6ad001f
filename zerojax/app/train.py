"""`python -m zerojax train`: a GPT preset trained under ZeRO, end to end.

Nothing here may start jax's backend before `start_runtime` (runtime.py): the simulated CPU
device count, the XLA flags and `jax.distributed` must all be set first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np

from zerojax.app.data import DataError, eval_batches
from zerojax.app.options import (
    CHECKPOINTS,
    TRAJECTORY,
    TrainConfig,
    UsageError,
    check_resume_before_steps,
    check_run_dir,
    check_split,
    parse_args,
    validate,
)
from zerojax.app.peers import PeerWatch
from zerojax.app.recipe import load_data, make_optimizer, resume_optimizer
from zerojax.app.resume import (
    drop_cut_off_record,
    intact_hint,
    missing_metrics_note,
    resume_changes,
    saved_config,
    schedule_note,
    supersede_steps,
)
from zerojax.app.runtime import select_devices, start_runtime
from zerojax.errors import CheckpointError, ZeroError


class RunStopped(RuntimeError):
    """The run cannot go on (a non-finite loss, a save that failed); reported as one line and
    exit code 1."""


class NonFiniteLoss(RunStopped):
    """The training loss became NaN or infinite."""


# --------------------------------------------------------------------------------- entry points


def main(argv: list[str] | None = None) -> int:
    """`python -m zerojax train [options]`; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg = parse_args(argv)
    except SystemExit as e:  # --help, or tyro's own report of a malformed option
        return e.code if isinstance(e.code, int) else 0
    except UsageError as e:
        return _fail(e, 2)
    try:
        cfg = validate(cfg)
        data = load_data(cfg)  # before the run directory: a bad file is named whatever --out holds
        check_run_dir(cfg)
    except (UsageError, DataError, ZeroError, FileNotFoundError) as e:
        return _fail(e, 2)
    start_runtime(cfg)
    watch = None
    try:
        import jax

        if jax.process_count() > 1:
            watch = PeerWatch(jax.process_count(), Path(cfg.out) / CHECKPOINTS)
        return train(cfg, data, watch)
    except (UsageError, DataError, ZeroError, FileNotFoundError) as e:
        return _fail(e, 2)
    except RunStopped as e:
        return _fail(e, 1)
    except KeyboardInterrupt:
        print("zerojax train: interrupted again; exiting without a checkpoint", file=sys.stderr)
        return 130
    except Exception:
        if watch is not None:  # a collective fails when a peer dies: say which, not a trace
            watch.settle()
        raise


def _fail(error: BaseException, code: int) -> int:
    print(f"zerojax train: error: {error}", file=sys.stderr)
    return code


class _Stop:
    """Remembers the first SIGINT (Ctrl-C) or SIGTERM; a second one acts as it did before."""

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum
        signal.signal(signum, self._previous[signum])

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# --------------------------------------------------------------------------------- the run


def train(cfg: TrainConfig, data: tuple[np.ndarray, np.ndarray, str],
          watch: PeerWatch | None = None) -> int:
    """Trains per `cfg` (validated, runtime started); returns the exit code."""
    import jax

    from zerojax import checkpoint
    from zerojax.analysis import flops
    from zerojax.analysis.measurement import optimizer_state_size
    from zerojax.app import records, report
    from zerojax.app.data import TokenBatches
    from zerojax.app.runlog import PeakWarning, RunLog, host_memory, mesh_text, over_peak
    from zerojax.config import DelayWarning, ZeroConfig, delay_advice
    from zerojax.engine import Engine
    from zerojax.mesh import make_mesh
    from zerojax.models import get_model
    from zerojax.offload.disk import disk_io

    t_start = time.perf_counter()
    pi, pc = jax.process_index(), jax.process_count()
    lead = pi == 0
    out, ckpt = Path(cfg.out), Path(cfg.out) / CHECKPOINTS
    console = report.make_console(quiet=not lead or cfg.quiet)
    devices = select_devices(cfg.devices)
    check_split(cfg, len(devices))
    m = cfg.model_parallel
    mesh = make_mesh(data=len(devices) // (cfg.replica * m), replica=cfg.replica, model=m,
                     devices=devices)
    model = get_model(cfg.model)
    notes = []
    stage, prefetch = cfg.stage, cfg.prefetch
    if cfg.xla_overlap and devices[0].platform != "gpu":
        notes.append(f"--xla-overlap: GPU flags, no effect on {devices[0].platform}")
    advice = cfg.delayed_update is not None and delay_advice(cfg.delayed_update, cfg.warmup,
                                                             "--delayed-update ")
    if advice and lead:  # the command line's own line, not ZeroConfig's DelayWarning
        print(f"zerojax train: warning: {advice}", file=sys.stderr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DelayWarning)
        zcfg = ZeroConfig(stage=stage, param_dtype=cfg.param_dtype, grad_accum=cfg.grad_accum,
                          clip_norm=cfg.clip_norm, remat=cfg.remat, prefetch=prefetch,
                          offload=cfg.offload, quantize_weights=cfg.quantize_weights,
                          quantize_grads=cfg.quantize_grads, hpz=cfg.hpz,
                          delayed_update=cfg.delayed_update,
                          offload_fraction=cfg.offload_fraction or 1.0,
                          offload_device=cfg.offload_device, nvme_path=cfg.nvme_path)
    if cfg.resume:  # before the optimizer is built: a resume continues the saved one
        from zerojax.checkpoint import read_metadata
        from zerojax.checkpoint.load import MisnamedStep, misnamed_note

        warnings.simplefilter("ignore", MisnamedStep)  # a note of the table says it instead
        notes += filter(None, [misnamed_note(ckpt)])
        try:
            saved = read_metadata(ckpt, cfg.resume_step)["extra"].get("train_config", {})
        except CheckpointError:
            saved = None  # the restore below names the damage and the intact steps to pick
        if saved is not None:
            cfg = resume_optimizer(cfg, saved)
    optimizer, schedule = make_optimizer(cfg)
    engine = Engine(model, optimizer, mesh, zcfg)
    check_host_memory(cfg, model, optimizer, devices, pi)

    train_tokens, eval_tokens, data_desc = data
    batches = TokenBatches(train_tokens, cfg.seq_len, cfg.batch, cfg.seed, pi, pc)
    rows = slice(pi * batches.local_batch, (pi + 1) * batches.local_batch)
    evals = [{k: v[rows] for k, v in b.items()}
             for b in eval_batches(eval_tokens, cfg.seq_len, cfg.batch, cfg.eval_batches)]

    extra = {"train_config": dataclasses.asdict(cfg)}
    if cfg.resume:
        from zerojax.checkpoint import read_metadata

        try:
            state = engine.restore(ckpt, cfg.resume_step)
        except CheckpointError as e:
            raise CheckpointError(intact_hint(e, "--resume-step")) from None
        start = int(state.step)
        check_resume_before_steps(cfg, start)
        old = read_metadata(ckpt, start)["extra"].get("train_config", {})
        resumed = {"from_step": start, "changed": resume_changes(old, cfg)}
        changed = [f"{k} {a!r} → {b!r}" for k, (a, b) in resumed["changed"].items()
                   if k in TRAJECTORY]
        if changed:
            notes.append("resumed with other options than saved: " + ", ".join(changed))
        if old and start < cfg.steps:
            notes += filter(None, [schedule_note(saved_config(old), cfg, start)])
        if cfg.resume_step is not None:
            if pc > 1:  # every process has read the step before process 0 moves any
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("zerojax resume-step")
            if lead:
                later, dest = supersede_steps(ckpt, start)
                if later:
                    notes.append(f"resuming from step {start}: later step(s) "
                                 f"{', '.join(map(str, later))} moved to {dest}/")
        if lead:
            notes += filter(None, [drop_cut_off_record(out / "metrics.jsonl"),
                                   missing_metrics_note(out / "metrics.jsonl", start)])
        if start == cfg.steps:
            notes.append(f"already at step {start} of --steps {cfg.steps}: nothing to train")
    else:
        state, resumed = engine.init(jax.random.key(cfg.seed), batches.batch(0)), None
    start = int(state.step)

    num_params = engine.layout.num_params
    mine = next(d for d in mesh.devices.flat if d.process_index == pi)
    measured, measured_host = report.state_bytes_split(engine, state, mine)
    split, applied = report.split_params(engine), report.host_share(engine)
    estimate = report.estimate_for(num_params, len(devices), stage, cfg,
                                   optimizer_state_size(engine).per_param, split, applied)
    step_flops = flops.step_flops(engine, batches.batch(start))
    peak, peak_from = flops.run_peak(devices[0], cfg.param_dtype, cfg.peak_tflops)
    console.print(report.startup_table(
        report.startup_rows(cfg, model, num_params, devices, mesh, data_desc, start, applied)
        + report.model_rows(engine)
        + ([("host update", report.host_update_text(engine.host_update))]
           if engine.host_update else [])
        + report.memory_rows(estimate, measured, measured_host, disk_io(engine))
        + report.comm_rows(cfg, num_params, len(devices), split, model.cfg)
        + [("flops", f"{flops.format_flops(step_flops)} per step = {flops.formula(model)}; "
                     + (f"MFU against {peak:g} TFLOP/s per device ({peak_from})" if peak
                        else f"no MFU: {peak_from}"))]
        + [("note", n) for n in notes], "zerojax train"))

    def evaluate(state) -> float:
        return float(np.mean([float(engine.evaluate(state, b)["loss"]) for b in evals]))

    title = f"{cfg.model}, stage {stage}, {len(devices)} devices ({mesh_text(mesh)})"
    warnings.simplefilter("ignore", PeakWarning)  # said below as the CLI's own line
    over_peak_said = False
    log = RunLog(out, engine, start=start, tensorboard=cfg.tensorboard, wandb=cfg.wandb,
                 config=extra["train_config"] | {"num_params": num_params,
                                                 "device_count": len(devices),
                                                 "flops_per_step": step_flops,
                                                 "peak_tflops": peak},
                 peak_tflops=peak, flops_per_step=step_flops, title=title)
    if resumed:  # in the resumed run's first record, whatever --quiet says
        log._note(resumed=resumed)
    tokens_per_step = cfg.batch * cfg.seq_len
    show = report.Reporter(console, cfg.steps, start, enabled=not cfg.quiet)
    stop = _Stop()
    times, eval_s, saved, interrupted = [], 0.0, {start} if cfg.resume else set(), False
    profiling = None
    step = start
    try:
        show.status(f"compiling the stage-{stage} step…" if start < cfg.steps else
                    f"already at step {start} of {cfg.steps}")
        if start == 0 and cfg.eval_every:
            t = time.perf_counter()
            log.eval(0, evaluate(state))
            eval_s += time.perf_counter() - t
        batch = batches.batch(start)
        for step in range(start, cfg.steps):
            if _agree(stop.signum is not None, pc):
                interrupted = True
                break
            if cfg.profile and step == start + 1:
                profiling = out / "profile"
                jax.profiler.start_trace(str(profiling))
            # An asynchronous save that failed stops the run at the next step, not the next
            # save; with several processes at the next save, where all of them wait for it.
            if saved and pc == 1:
                with saving(ckpt):
                    checkpoint.check_saves(ckpt)
            t = time.perf_counter()
            state, metrics = engine.step(state, batch)
            if step + 1 < cfg.steps:  # the host builds the next batch while the device works
                batch = batches.batch(step + 1)
            loss = float(metrics["loss"])
            dt = time.perf_counter() - t
            if profiling and step == start + 3:
                jax.profiler.stop_trace()
                profiling = False
            if not math.isfinite(loss) and not cfg.allow_nonfinite:
                raise NonFiniteLoss(
                    f"loss is {loss} at step {step + 1} (lr {float(schedule(step)):.3g}); "
                    f"stopped without saving; {last_good(ckpt)}. Lower --lr, set --clip-norm, "
                    f"use --param-dtype float32, or pass --allow-nonfinite to go on")
            times.append(dt)
            ev = None
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                t = time.perf_counter()
                ev = evaluate(state)
                eval_s += time.perf_counter() - t
            rec = log.step(step + 1, metrics, seconds=dt, lr=float(schedule(step)),
                           tokens=tokens_per_step, eval_loss=ev)
            show.update(rec)
            if rec.get("mfu", 0) > 1 and lead and not over_peak_said:
                over_peak_said = True
                print(f"zerojax train: warning: {over_peak(rec['mfu'], step + 1, peak)}",
                      file=sys.stderr)
            if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
                log.flush()  # the checkpoint's steps are in every sink before it commits
                with saving(ckpt):
                    engine.save(state, ckpt, step + 1, wait=False, extra=extra)
                saved.add(step + 1)
    except BaseException:
        log.close(failed=True)
        raise
    finally:
        stop.close()
        show.close()
        if profiling:
            jax.profiler.stop_trace()
    step = int(state.step)  # also right when resumed at --steps, or interrupted
    try:  # the state first: a full disk may fail the plot, which is redrawn on resume
        with saving(ckpt):
            if step not in saved and step > 0:
                engine.save(state, ckpt, step, wait=True, extra=extra)
            if saved:
                checkpoint.wait_until_finished(ckpt)
    except BaseException:
        log.close(failed=True)
        raise
    log.close()

    summary = records.summary(cfg, log.records, times, num_params, devices, mesh, estimate,
                              measured, time.perf_counter() - t_start, eval_s, step, interrupted,
                              flops={"per_step": step_flops, "formula": flops.formula(model),
                                     "peak_tflops": peak, "peak_from": peak_from},
                              host_update=engine.host_update, host_memory=host_memory(),
                              resumed=resumed, nvme=disk_io(engine))
    if lead:
        records.finish(out, summary)
    if watch is not None:
        watch.leave(lead)
    if interrupted:
        if lead:
            saved_msg = (f"checkpoint saved in {ckpt} (continue with --resume)" if step else
                         "nothing to save before the first step")
            print(f"zerojax train: interrupted at step {step}; {saved_msg}", file=sys.stderr)
        return 128 + (stop.signum or signal.SIGINT)  # 130 for Ctrl-C, 143 for SIGTERM
    return 0


def check_host_memory(cfg: TrainConfig, model, optimizer, devices, process: int) -> None:
    """With offload, before the state is made: a UsageError when this process's share of the
    host state, at the update's peak, exceeds the host memory available now. Such a run is
    otherwise ended by the out-of-memory killer, without a word, once init fills the host."""
    import psutil

    from zerojax.analysis.accounting import format_bytes as fmt
    from zerojax.app import report

    need, estimate = report.host_need(cfg, model, optimizer, devices, process)
    free = psutil.virtual_memory().available
    if need <= free:
        return
    mine = round(need / estimate.memory.host_peak)  # this process's devices
    when = "while the state is saved or restored (the NVMe tier holds it whole then; " \
        "docs/nvme.md)" if cfg.offload_device == "nvme" else "while the update runs"
    raise UsageError(
        f"--offload {cfg.offload}: this process's {mine} device(s) need about {fmt(need)} of "
        f"host memory {when} ({fmt(estimate.memory.host_peak)} each: the "
        f"float32 master, the {estimate.held}, the gradient and compute shards; `zerojax "
        f"estimate` counts it), but {fmt(free)} is available; train a smaller --model, keep "
        f"part of the state on the devices (--offload-fraction below 1), or spread the run "
        f"over more hosts")


def last_good(ckpt: Path) -> str:
    """Where the run can go on from: the latest complete checkpoint step, if any (once the
    saves still being written are done)."""
    from zerojax import checkpoint
    from zerojax.app.options import checkpoint_steps

    try:
        checkpoint.wait_until_finished(ckpt)
    except CheckpointError:  # a failed save leaves the steps before it, which are listed
        pass
    steps = checkpoint_steps(ckpt)
    if not steps:
        return "no checkpoint was saved"
    return f"last good checkpoint: step {steps[-1]} in {ckpt} (continue with --resume)"


@contextlib.contextmanager
def saving(ckpt: Path):
    """A save that fails (a full disk, a state that is NaN) stops the run with one line naming
    the step and the last good checkpoint."""
    try:
        yield
    except CheckpointError as e:
        if e.nonfinite is None:
            raise RunStopped(f"{e.damage or e}; {last_good(ckpt)}") from None
        raise RunStopped(f"step {e.step}: {e.nonfinite} holds NaN or inf (the run has "
                         f"diverged), so it was not saved; {last_good(ckpt)}") from None


def _agree(flag: bool, processes: int) -> bool:
    """True when any process has `flag` set (so all processes stop at the same step)."""
    if processes == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))
