"""`python -m zerojax train`: a GPT preset trained under ZeRO, end to end.

Nothing here may start jax's backend before `start_runtime`: the simulated CPU device count,
the XLA flags and `jax.distributed` must all be set first.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
import tyro

from zerojax.data import DataError, embedded_corpus, eval_batches, load_tokens, split_tokens
from zerojax.errors import ZeroError
from zerojax.models import PRESETS

DEFAULT_CPU_DEVICES = 4
_FORCE = "--xla_force_host_platform_device_count"
# Options that change a run's trajectory (the data order or the updates), unlike devices,
# stage or output options; a resume that changes them is reported.
_TRAJECTORY = ("batch", "seq_len", "seed", "data", "steps", "lr", "warmup", "schedule",
               "min_lr_ratio", "weight_decay", "grad_accum", "clip_norm", "param_dtype")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Train a GPT preset under ZeRO on the embedded corpus (no download) or a token file."""

    model: str = "nano"
    """GPT preset: test, nano, small8, gpt2-small, 1b or 7b."""
    stage: Literal[0, 1, 2, 3] = 3
    """ZeRO stage: 0 (DDP), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters)."""
    devices: int | None = None
    """Devices per process: simulated on CPU (default 4); on GPU the first N (default all)."""
    replica: int = 1
    """Replica groups for hybrid sharding: state sharded within a group, replicated across."""
    steps: int = 200
    """Total optimizer steps (a resumed run continues up to this step)."""
    batch: int = 16
    """Global batch in sequences, over all processes and devices."""
    seq_len: int | None = None
    """Tokens per sequence; default and maximum: the preset's context length."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    warmup: int = 10
    """Linear warm-up steps up to --lr."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """After warm-up: cosine decay to --min-lr-ratio × --lr at --steps, or constant."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of --lr."""
    weight_decay: float = 0.1
    """AdamW weight decay of matrices and embeddings (not biases or LayerNorm)."""
    grad_accum: int = 1
    """Micro-batches per step (each device's batch is split this many ways)."""
    clip_norm: float | None = 1.0
    """Clip gradients to this global norm; None disables clipping."""
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of params and grads (masters, Adam: fp32; float16: loss scaling)."""
    remat: bool = True
    """Recompute each layer in backward instead of saving its activations."""
    prefetch: bool = False
    """Stage 3: gather layer i+1's parameters while layer i computes."""
    out: str = "runs/train"
    """Run directory: metrics.jsonl, loss.png, summary.json, checkpoints/, profile/."""
    save_every: int = 0
    """Save a checkpoint every N steps; 0: only at the end (and on Ctrl-C)."""
    resume: bool = False
    """Continue from the latest checkpoint in OUT/checkpoints."""
    eval_every: int = 50
    """Eval loss every N steps (and before the first and after the last); 0: never."""
    eval_batches: int = 4
    """Fixed held-out batches (of --batch sequences) averaged for the eval loss."""
    seed: int = 0
    """Seed of the initial parameters and of the data order."""
    profile: bool = False
    """Write a jax.profiler trace of a few steps to OUT/profile (TensorBoard / Perfetto)."""
    data: str | None = None
    """Token file (.txt bytes, .bin uint16, .npy) instead of the corpus; its last 5% is eval."""
    coordinator: str | None = None
    """HOST:PORT of process 0 (with --num-processes, --process-id); SLURM/Open MPI: automatic."""
    num_processes: int | None = None
    """Processes in a multi-process run."""
    process_id: int | None = None
    """This process's index in a multi-process run."""
    xla_overlap: bool = False
    """On GPU: set XLA's latency-hiding scheduler and pipelined collective flags."""
    quiet: bool = False
    """No table and no progress; only errors and a final line."""
    config: str | None = None
    """JSON or TOML file of these options (keys: option names); command-line flags override it."""


class UsageError(ValueError):
    """A bad command-line option; reported as one line and exit code 2."""


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or infinite."""


# --------------------------------------------------------------------------------- options


def parse_args(argv: list[str]) -> TrainConfig:
    """Options from `--config FILE` (if given) overridden by the command line."""
    default = TrainConfig()
    path = _flag_value(argv, "--config")
    if path is not None:
        default = dataclasses.replace(default, **load_config_file(path), config=path)
    return tyro.cli(TrainConfig, args=argv, default=default, prog="python -m zerojax train")


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def load_config_file(path: str) -> dict[str, Any]:
    """TrainConfig fields from a JSON or TOML file."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"config file not found: {path!r}")
    try:
        if p.suffix.lower() == ".toml":
            import tomllib

            values = tomllib.loads(p.read_text())
        else:
            values = json.loads(p.read_text())
    except (ValueError, ImportError) as e:
        raise UsageError(f"cannot read config file {path!r}: {e}") from None
    if not isinstance(values, dict):
        raise UsageError(f"config file {path!r} must hold a table/object of options")
    values = {k.replace("-", "_"): v for k, v in values.items()}
    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"config"}
    unknown = sorted(set(values) - names)
    if unknown:
        raise UsageError(f"unknown option(s) {unknown} in config file {path!r}; see --help")
    return values


def validate(cfg: TrainConfig) -> TrainConfig:
    """Checks every option that can be checked before jax starts; fills in the defaults."""
    for name, low in [*((n, 1) for n in ("steps", "batch", "replica", "grad_accum",
                                         "eval_batches", "devices", "seq_len")),
                      *((n, 0) for n in ("save_every", "eval_every", "warmup", "seed"))]:
        v = getattr(cfg, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            kind = "a positive" if low else "a non-negative"
            raise UsageError(f"--{name.replace('_', '-')}={v!r} must be {kind} integer")
    if cfg.model not in PRESETS:
        raise UsageError(f"unknown GPT preset --model={cfg.model!r}; choose one of "
                         f"{', '.join(PRESETS)}")
    if cfg.stage not in (0, 1, 2, 3):
        raise UsageError(f"--stage={cfg.stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
    if not cfg.lr > 0 or not 0 <= cfg.min_lr_ratio <= 1 or cfg.weight_decay < 0:
        raise UsageError(f"--lr={cfg.lr} must be positive, --min-lr-ratio={cfg.min_lr_ratio} "
                         f"in [0, 1] and --weight-decay={cfg.weight_decay} non-negative")
    ctx = PRESETS[cfg.model].seq_len
    seq_len = ctx if cfg.seq_len is None else cfg.seq_len
    if seq_len > ctx:
        raise UsageError(f"--seq-len={seq_len} exceeds preset {cfg.model!r}'s context length "
                         f"{ctx}")
    dist = (cfg.coordinator, cfg.num_processes, cfg.process_id)
    if any(v is not None for v in dist) and any(v is None for v in dist):
        raise UsageError("--coordinator, --num-processes and --process-id go together; give "
                         "all three (or none, to auto-detect SLURM / Open MPI)")
    if cfg.num_processes is not None and not 0 <= cfg.process_id < cfg.num_processes:
        raise UsageError(f"--process-id={cfg.process_id} must be in [0, --num-processes="
                         f"{cfg.num_processes})")
    if cfg.devices is not None:
        check_split(cfg, cfg.devices * (cfg.num_processes or 1))
    if cfg.prefetch and cfg.stage != 3:
        raise UsageError(f"--prefetch needs --stage 3 (got --stage {cfg.stage})")
    steps = checkpoint_steps(Path(cfg.out) / "checkpoints")
    if cfg.resume and not steps:
        raise UsageError(f"--resume: no checkpoint in {str(Path(cfg.out) / 'checkpoints')!r}; "
                         f"train without --resume first, or point --out at the run")
    if not cfg.resume and steps:
        raise UsageError(f"{cfg.out!r} already holds checkpoints (latest step {max(steps)}); "
                         f"pass --resume to continue it or choose another --out")
    return dataclasses.replace(cfg, seq_len=seq_len)


def check_split(cfg: TrainConfig, devices: int) -> None:
    """The global batch must split evenly over processes, devices, replicas and micro-batches."""
    if devices % cfg.replica:
        raise UsageError(f"{devices} devices do not split into --replica={cfg.replica} groups")
    if cfg.batch % devices:
        raise UsageError(f"--batch={cfg.batch} is not divisible by the {devices} devices; use a "
                         f"multiple of {devices}")
    if (cfg.batch // devices) % cfg.grad_accum:
        raise UsageError(f"per-device batch {cfg.batch // devices} is not divisible by "
                         f"--grad-accum={cfg.grad_accum}; use a --batch that is a multiple of "
                         f"{devices * cfg.grad_accum}")


def checkpoint_steps(directory: Path) -> list[int]:
    """The complete (integer-named) step directories of a checkpoint directory."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def load_data(cfg: TrainConfig) -> tuple[np.ndarray, np.ndarray, str]:
    """`(train, eval, description)` tokens: the embedded corpus or `--data`."""
    if cfg.data is None:
        train, ev = embedded_corpus(split="train"), embedded_corpus(split="eval")
        what = "embedded stdlib corpus"
    else:
        train, ev = split_tokens(load_tokens(cfg.data))
        what = cfg.data
    vocab = PRESETS[cfg.model].vocab_size
    if np.iinfo(train.dtype).max >= vocab:  # only when the dtype can hold larger ids
        # A prefix of a large memory-mapped file; ids past it make the loss NaN, which stops
        # the run naming the step.
        top = max(int(train[:2**26].max()), int(ev[:2**26].max()))
        if top >= vocab:
            raise UsageError(f"{what} has token id {top} but preset {cfg.model!r} has "
                             f"vocab_size {vocab}; use a larger preset or re-tokenize")
    for name, t in (("train", train), ("eval", ev)):
        if len(t) <= cfg.seq_len:
            raise UsageError(f"{what}: {len(t)} {name} tokens are too few for --seq-len="
                             f"{cfg.seq_len}")
    return train, ev, f"{what}: {len(train):,} train / {len(ev):,} eval tokens"


# --------------------------------------------------------------------------------- runtime


def start_runtime(cfg: TrainConfig) -> None:
    """XLA flags and `jax.distributed`, before anything starts jax's backend."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if cfg.devices is not None or not any(f.startswith(_FORCE) for f in flags):
        flags = [f for f in flags if not f.startswith(_FORCE)]
        flags.append(f"{_FORCE}={cfg.devices or DEFAULT_CPU_DEVICES}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    if cfg.xla_overlap:
        from zerojax.overlap import DEFAULT_COMBINE_BYTES, apply_overlap_flags

        c = PRESETS[cfg.model]
        layer = (4 * c.d_model**2 + 2 * c.d_model * c.d_ff) * (4 if cfg.param_dtype ==
                                                                "float32" else 2)
        apply_overlap_flags(combine_threshold_bytes=max(layer, DEFAULT_COMBINE_BYTES))


    from zerojax.mesh import initialize_distributed

    multi = any(int(os.environ.get(v, "1")) > 1 for v in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))
    if cfg.coordinator is not None or multi:
        initialize_distributed(cfg.coordinator, cfg.num_processes, cfg.process_id)


def make_optimizer(cfg: TrainConfig):
    """AdamW with linear warm-up then cosine (or constant); returns (optimizer, schedule)."""
    import optax

    w, lr = cfg.warmup, cfg.lr
    if cfg.schedule == "cosine":
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=lr / w if w else lr, peak_value=lr, warmup_steps=w,
            decay_steps=max(cfg.steps, w + 1), end_value=lr * cfg.min_lr_ratio)
    else:
        schedule = optax.join_schedules(
            [optax.linear_schedule(lr / w if w else lr, lr, w), optax.constant_schedule(lr)], [w])
    # Leaves keep their names in the engine's flat layout, so the mask goes by name, not ndim.
    decay = lambda params: _map_names(params, lambda name: name in ("kernel", "tok", "pos"))
    opt = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decay)
    return opt, schedule


def _map_names(tree, fn):
    import jax

    return jax.tree_util.tree_map_with_path(lambda path, _: fn(str(path[-1].key)), tree)


def select_devices(per_process: int | None):
    """The first `per_process` local devices of every process (all of them when None)."""
    import jax

    devices = []
    for p in range(jax.process_count()):
        local = [d for d in jax.devices() if d.process_index == p]
        if per_process is not None and per_process > len(local):
            raise UsageError(f"--devices={per_process} but process {p} has only {len(local)} "
                             f"{local[0].platform} device(s)")
        devices += local[:per_process]
    return devices


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
        data = load_data(cfg)
    except (UsageError, DataError, ZeroError, FileNotFoundError) as e:
        return _fail(e, 2)
    start_runtime(cfg)
    try:
        return train(cfg, data)
    except (UsageError, DataError, ZeroError, FileNotFoundError) as e:
        return _fail(e, 2)
    except NonFiniteLoss as e:
        return _fail(e, 1)
    except KeyboardInterrupt:
        print("zerojax train: interrupted again; exiting without a checkpoint", file=sys.stderr)
        return 130


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


def train(cfg: TrainConfig, data: tuple[np.ndarray, np.ndarray, str]) -> int:
    """Trains per `cfg` (validated, runtime started); returns the exit code."""
    import jax

    from zerojax import report
    from zerojax.config import ZeroConfig
    from zerojax.data import TokenBatches
    from zerojax.engine import Engine
    from zerojax.mesh import make_mesh
    from zerojax.models import get_model

    t_start = time.perf_counter()
    pi, pc = jax.process_index(), jax.process_count()
    lead = pi == 0
    out, ckpt = Path(cfg.out), Path(cfg.out) / "checkpoints"
    console = report.make_console(quiet=not lead or cfg.quiet)
    devices = select_devices(cfg.devices)
    check_split(cfg, len(devices))
    mesh = make_mesh(data=len(devices) // cfg.replica, replica=cfg.replica, devices=devices)
    model = get_model(cfg.model)
    notes = []
    stage, prefetch = cfg.stage, cfg.prefetch
    if cfg.xla_overlap and devices[0].platform != "gpu":
        notes.append(f"--xla-overlap: GPU flags, no effect on {devices[0].platform}")
    zcfg = ZeroConfig(stage=stage, param_dtype=cfg.param_dtype, grad_accum=cfg.grad_accum,
                      clip_norm=cfg.clip_norm, remat=cfg.remat, prefetch=prefetch)
    optimizer, schedule = make_optimizer(cfg)
    engine = Engine(model, optimizer, mesh, zcfg)

    train_tokens, eval_tokens, data_desc = data
    batches = TokenBatches(train_tokens, cfg.seq_len, cfg.batch, cfg.seed, pi, pc)
    rows = slice(pi * batches.local_batch, (pi + 1) * batches.local_batch)
    evals = [{k: v[rows] for k, v in b.items()}
             for b in eval_batches(eval_tokens, cfg.seq_len, cfg.batch, cfg.eval_batches)]

    extra = {"train_config": dataclasses.asdict(cfg)}
    if cfg.resume:
        from zerojax.checkpoint import read_metadata

        state = engine.restore(ckpt)
        old = read_metadata(ckpt, int(state.step))["extra"].get("train_config", {})
        changed = [f"{k} {old[k]!r} → {v!r}" for k, v in extra["train_config"].items()
                   if k in _TRAJECTORY and k in old and old[k] != v]
        if changed:
            notes.append("resumed with other options than saved: " + ", ".join(changed))
    else:
        state = engine.init(jax.random.key(cfg.seed), batches.batch(0))
    start = int(state.step)

    num_params = engine.layout.num_params
    mine = next(d for d in mesh.devices.flat if d.process_index == pi)
    measured = report.state_bytes_per_device(state, mine)
    estimate = report.estimate_for(num_params, len(devices), stage, cfg)
    console.print(report.startup_table(
        report.startup_rows(cfg, model, num_params, devices, mesh, data_desc, start)
        + report.memory_rows(estimate, measured)
        + [("note", n) for n in notes], "zerojax train"))

    def evaluate(state) -> float:
        return float(np.mean([float(engine.evaluate(state, b)["loss"]) for b in evals]))

    log = report.MetricsLog(out / "metrics.jsonl", start, enabled=lead)
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
            log.write({"step": 0, "eval_loss": evaluate(state)})
            eval_s += time.perf_counter() - t
        batch = batches.batch(start)
        for step in range(start, cfg.steps):
            if _agree(stop.signum is not None, pc):
                interrupted = True
                break
            if cfg.profile and step == start + 1:
                profiling = out / "profile"
                jax.profiler.start_trace(str(profiling))
            t = time.perf_counter()
            state, metrics = engine.step(state, batch)
            if step + 1 < cfg.steps:  # the host builds the next batch while the device works
                batch = batches.batch(step + 1)
            loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
            dt = time.perf_counter() - t
            if profiling and step == start + 3:
                jax.profiler.stop_trace()
                profiling = False
            if not math.isfinite(loss):
                raise NonFiniteLoss(
                    f"loss is {loss} at step {step + 1} (lr {float(schedule(step)):.3g}); "
                    f"stopped without saving. Lower --lr, set --clip-norm, or use "
                    f"--param-dtype float32")
            times.append(dt)
            rec = {"step": step + 1, "loss": loss, "grad_norm": grad_norm,
                   "lr": float(schedule(step)), "tokens_per_s": tokens_per_step / dt,
                   "step_time_s": dt}
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                t = time.perf_counter()
                rec["eval_loss"] = evaluate(state)
                eval_s += time.perf_counter() - t
            log.write(rec)
            show.update(rec)
            if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
                engine.save(state, ckpt, step + 1, wait=False, extra=extra)
                saved.add(step + 1)
    finally:
        stop.close()
        show.close()
        if profiling:
            jax.profiler.stop_trace()
    step = int(state.step)  # also right when resumed past --steps, or interrupted
    if step not in saved and step > 0:
        engine.save(state, ckpt, step, wait=True, extra=extra)
    if saved:
        from zerojax import checkpoint

        checkpoint.wait_until_finished(ckpt)

    summary = report.summary(cfg, log.records, times, num_params, devices, mesh, estimate,
                             measured, time.perf_counter() - t_start, eval_s, step, interrupted)
    if lead:
        report.finish(out, log.records, summary, f"{cfg.model}, stage {stage}, "
                                                 f"{len(devices)} devices")
    if interrupted:
        if lead:
            saved_msg = (f"checkpoint saved in {ckpt} (continue with --resume)" if step else
                         "nothing to save before the first step")
            print(f"zerojax train: interrupted at step {step}; {saved_msg}", file=sys.stderr)
        return 128 + (stop.signum or signal.SIGINT)  # 130 for Ctrl-C, 143 for SIGTERM
    return 0


def _agree(flag: bool, processes: int) -> bool:
    """True when any process has `flag` set (so all processes stop at the same step)."""
    if processes == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))
