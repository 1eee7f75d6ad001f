"""`zerojax train`'s options: `TrainConfig`, parsing (`--config` file, then flags),
validation and the run directory (recipe.py: the data and optimizer they describe). Nothing
here starts jax's backend.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro

from zerojax.app.cmdline import check_values, one_line_errors
from zerojax.app.files import not_a_directory
from zerojax.app.presets import HELP, OPTIMIZERS
from zerojax.models import PRESETS

CHECKPOINTS = "checkpoints"  # train saves its checkpoints in OUT/checkpoints

# Options that change a run's trajectory (the data order or the updates), unlike devices,
# stage or output options; a resume that changes them is reported.
TRAJECTORY = ("batch", "seq_len", "seed", "data", "steps", "lr", "warmup", "schedule",
              "min_lr_ratio", "weight_decay", "grad_accum", "clip_norm", "param_dtype",
              "quantize_weights", "quantize_grads", "delayed_update")


OPTIMIZER_HELP = ("Default adamw; a resume continues with the saved one. "
                  + " ".join(f"{name}: {text}." for name, text in HELP.items())
                  + " All take --lr and --weight-decay.")


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
    model_parallel: int = 1
    """M: tensor parallelism over a model axis of M neighbouring devices (mesh replica × data ×
    model): each layer's matmuls, the embedding and the head split as Megatron does, ZeRO over
    the data axis of devices / (replica × M); must divide the preset's heads."""
    steps: int = 200
    """Total optimizer steps (a resumed run continues up to this step)."""
    batch: int = 16
    """Global batch in sequences, over all processes and devices."""
    seq_len: int | None = None
    """Tokens per sequence; default and maximum: the preset's context length."""
    optimizer: Annotated[Literal["adamw", "lion", "adafactor", "muon", "lamb", "sgd"] | None,
                         tyro.conf.arg(help=OPTIMIZER_HELP)] = None
    """The optimizer (default adamw; a resume continues with the saved one); see --help."""
    lr: float = 3e-3
    """Peak learning rate."""
    warmup: int = 10
    """Linear warm-up steps up to --lr."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """After warm-up: cosine decay to --min-lr-ratio × --lr at --steps, or constant."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of --lr."""
    weight_decay: float = 0.1
    """Weight decay of matrices and embeddings, not biases or LayerNorm (muon: its matrices)."""
    grad_accum: int = 1
    """Micro-batches per step (each device's batch is split this many ways)."""
    clip_norm: float | None = 1.0
    """Clip gradients to this global norm; None disables clipping."""
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of params and grads (masters, optimizer: fp32; float16: loss scaling)."""
    remat: bool = True
    """Recompute each layer in backward instead of saving its activations."""
    prefetch: bool = False
    """Stage 3: gather layer i+1's parameters while layer i computes."""
    offload: Literal["optimizer"] | None = None
    """optimizer: keep the fp32 master and optimizer state in host memory (stages 1-3)."""
    delayed_update: int | None = None
    """With --offload: after K ordinary steps, each step's forward and backward run on the
    params before the previous step's update, while the host computes that update (DPU)."""
    offload_fraction: float | None = None
    """With --offload: the host's share of the params' master, optimizer state and update, in
    (0, 1] (default 1); the devices keep and update the rest (Twin-Flow)."""
    offload_device: Literal["cpu", "nvme"] = "cpu"
    """With --offload: where the host's share of the fp32 master and Adam moments lives: cpu
    (host memory) or nvme (ZeRO-Infinity: files under --nvme-path, streamed through the
    host's update every step; --optimizer adamw)."""
    nvme_path: str | None = None
    """With --offload-device nvme: the directory of this process's store, on a fast local
    disk (a working copy: the checkpoints stay the record)."""
    quantize_weights: Literal["int8"] | None = None
    """ZeRO++ qwZ (stages 1-3): gather params as block-quantized int8 (half of bf16's bytes)."""
    quantize_grads: Literal["int8", "int4"] | None = None
    """ZeRO++ qgZ: reduce gradients as block-quantized int8/int4 pieces, summed in float32."""
    hpz: bool = False
    """ZeRO++ hpZ (stage 3, --replica > 1): a secondary param copy sharded within each replica
    group, so the per-layer gathers stay inside it."""
    out: str = "runs/train"
    """Run directory: metrics.jsonl, loss.png, summary.json, checkpoints/, tensorboard/."""
    save_every: int = 0
    """Save a checkpoint every N steps; 0: only at the end (and on Ctrl-C)."""
    resume: bool = False
    """Continue from the latest checkpoint in OUT/checkpoints."""
    resume_step: int | None = None
    """Continue from this checkpoint step instead of the latest (implies --resume)."""
    eval_every: int = 50
    """Eval loss every N steps (and before the first and after the last); 0: never."""
    eval_batches: int = 4
    """Fixed held-out batches (of --batch sequences) averaged for the eval loss."""
    seed: int = 0
    """Seed of the initial parameters and of the data order."""
    profile: bool = False
    """Write a jax.profiler trace of a few steps to OUT/profile (TensorBoard / Perfetto)."""
    tensorboard: bool = True
    """Write TensorBoard scalars to OUT/tensorboard (view: tensorboard --logdir runs/)."""
    wandb: str | None = None
    """Also log to this Weights & Biases project (pip install 'zerojax[wandb]'; offline with
    WANDB_MODE=offline)."""
    peak_tflops: float | None = None
    """Per-device peak TFLOP/s for MFU; default: the device's dense bf16/fp16 peak when it is
    known and the compute is bfloat16/float16."""
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
    allow_nonfinite: bool = False
    """Go on past a NaN or inf loss (float16 loss scaling skips such steps) instead of
    stopping; a checkpoint of a NaN state is still refused."""
    config: str | None = None
    """JSON or TOML file of these options (keys: option names); command-line flags override it."""


class UsageError(ValueError):
    """A bad command-line option; reported as one line and exit code 2."""


def parse_args(argv: list[str]) -> TrainConfig:
    """Options from `--config FILE` (if given) overridden by the command line."""
    default = TrainConfig()
    path = _flag_value(argv, "--config")
    values = {}
    if path is not None:
        values = load_config_file(path)
        default = dataclasses.replace(default, **values, config=path)
    check_values(argv, TrainConfig, UsageError)
    cfg = one_line_errors(lambda: tyro.cli(TrainConfig, args=argv, default=default,
                                           prog="python -m zerojax train"), UsageError)
    # --resume-step implies --resume, so only an explicit "no" contradicts it: the last of
    # --resume / --no-resume on the command line, else the config file's resume = false.
    said = [a for a in argv if a in ("--resume", "--no-resume")]
    no = said[-1] == "--no-resume" if said else values.get("resume") is False
    if no and cfg.resume_step is not None:
        where = "--no-resume" if said else f"resume = false in {path!r}"
        raise UsageError(f"{where} contradicts --resume-step={cfg.resume_step} (which resumes "
                         f"from that step); drop one of them")
    return cfg


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
    except OSError as e:
        raise UsageError(f"cannot read config file {path!r}: {e.strerror or e}") from None
    if not isinstance(values, dict):
        raise UsageError(f"config file {path!r} must hold a table/object of options")
    values = {k.replace("-", "_"): v for k, v in values.items()}
    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"config"}
    unknown = sorted(set(values) - names)
    if unknown:
        raise UsageError(f"unknown option(s) {unknown} in config file {path!r}; see --help")
    return values


# Integer options and their lowest value; all stay below INT_LIMIT (the step counter is int32)
# except the seed, which jax.random.key takes as int64.
_INTS = {"steps": 1, "batch": 1, "replica": 1, "model_parallel": 1, "grad_accum": 1,
         "eval_batches": 1, "devices": 1, "seq_len": 1, "save_every": 0, "eval_every": 0,
         "warmup": 0, "seed": 0, "delayed_update": 0, "resume_step": 1, "num_processes": 1,
         "process_id": 0}
INT_LIMIT, SEED_LIMIT = 2**31, 2**63


def validate(cfg: TrainConfig) -> TrainConfig:
    """Checks every option that can be checked without files or jax; fills in the defaults."""
    for name, low in _INTS.items():
        v = getattr(cfg, name)
        high = SEED_LIMIT if name == "seed" else INT_LIMIT
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)
                              or not low <= v < high):
            kind = "a positive" if low else "a non-negative"
            raise UsageError(f"--{flag(name)}={v!r} must be {kind} integer below "
                             f"2**{high.bit_length() - 1}")
    for field in dataclasses.fields(cfg):  # nan passes every comparison below; inf makes nan
        v = getattr(cfg, field.name)
        if isinstance(v, float) and not math.isfinite(v):
            raise UsageError(f"--{flag(field.name)}={v} must be a finite number")
    if cfg.model not in PRESETS:
        raise UsageError(f"unknown GPT preset --model={cfg.model!r}; choose one of "
                         f"{', '.join(PRESETS)}")
    if cfg.optimizer is not None and cfg.optimizer not in OPTIMIZERS:
        raise UsageError(f"unknown --optimizer={cfg.optimizer!r}; choose one of "
                         f"{', '.join(OPTIMIZERS)}")
    if cfg.stage not in (0, 1, 2, 3):
        raise UsageError(f"--stage={cfg.stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
    if not cfg.lr > 0 or not 0 <= cfg.min_lr_ratio <= 1 or cfg.weight_decay < 0:
        raise UsageError(f"--lr={cfg.lr} must be positive, --min-lr-ratio={cfg.min_lr_ratio} "
                         f"in [0, 1] and --weight-decay={cfg.weight_decay} non-negative")
    if cfg.clip_norm is not None and not cfg.clip_norm > 0:
        raise UsageError(f"--clip-norm={cfg.clip_norm} must be positive (None turns clipping "
                         f"off)")
    ctx = PRESETS[cfg.model].seq_len
    seq_len = ctx if cfg.seq_len is None else cfg.seq_len
    if seq_len > ctx:
        raise UsageError(f"--seq-len={seq_len} exceeds the context length of preset "
                         f"{cfg.model!r}, {ctx}")
    dist = (cfg.coordinator, cfg.num_processes, cfg.process_id)
    if any(v is not None for v in dist) and any(v is None for v in dist):
        raise UsageError("--coordinator, --num-processes and --process-id go together; give "
                         "all three (or none, to auto-detect SLURM / Open MPI)")
    if cfg.num_processes is not None and not 0 <= cfg.process_id < cfg.num_processes:
        raise UsageError(f"--process-id={cfg.process_id} must be in [0, --num-processes="
                         f"{cfg.num_processes})")
    if cfg.coordinator is not None:
        check_coordinator(cfg.coordinator)
    if cfg.devices is not None:
        check_split(cfg, cfg.devices * (cfg.num_processes or 1))
    heads = PRESETS[cfg.model].n_heads
    if heads % cfg.model_parallel:
        raise UsageError(f"--model-parallel={cfg.model_parallel} does not divide the {heads} "
                         f"attention heads of preset {cfg.model!r} (Megatron gives each model "
                         f"device whole heads); use a divisor of {heads}")
    if cfg.prefetch and cfg.stage != 3:
        raise UsageError(f"--prefetch needs --stage 3 (got --stage {cfg.stage})")
    if cfg.offload is not None and cfg.offload != "optimizer":
        raise UsageError(f"--offload={cfg.offload!r} is not an offload mode; use optimizer")
    if cfg.offload is not None and cfg.stage == 0:
        raise UsageError(f"--offload {cfg.offload} needs --stage 1, 2 or 3 (got --stage 0): "
                         f"stage 0 has no optimizer shard to offload")
    if cfg.delayed_update is not None and cfg.offload is None:
        raise UsageError(f"--delayed-update {cfg.delayed_update} needs --offload optimizer: "
                         f"the delay lets the host's update run while the device computes")
    if cfg.offload_fraction is not None and (cfg.offload is None or isinstance(
            cfg.offload_fraction, bool) or not 0 < cfg.offload_fraction <= 1):
        raise UsageError(f"--offload-fraction {cfg.offload_fraction} needs --offload optimizer "
                         f"and a value in (0, 1]: the host's share of the params' update")
    if cfg.offload_device not in ("cpu", "nvme"):
        raise UsageError(f"--offload-device={cfg.offload_device!r} is not an offload device; "
                         f"use cpu or nvme")
    if cfg.offload_device == "nvme" and (cfg.offload is None or not cfg.nvme_path):
        raise UsageError("--offload-device nvme needs --offload optimizer and --nvme-path DIR "
                         "(the directory of this process's store, on a fast local disk)")
    if cfg.nvme_path is not None and cfg.offload_device != "nvme":
        raise UsageError(f"--nvme-path {cfg.nvme_path} needs --offload-device nvme (got "
                         f"--offload-device {cfg.offload_device}); add --offload-device nvme")
    if cfg.quantize_weights is not None and cfg.stage == 0:
        raise UsageError(f"--quantize-weights {cfg.quantize_weights} needs --stage 1, 2 or 3 "
                         f"(got --stage 0): stage 0 gathers no params; use --quantize-grads")
    if cfg.hpz and (cfg.stage != 3 or cfg.replica < 2):
        raise UsageError(f"--hpz needs --stage 3 and --replica R > 1 (got --stage {cfg.stage}, "
                         f"--replica {cfg.replica}): hpZ shards a secondary copy of the params "
                         f"within each replica group")
    if cfg.peak_tflops is not None and not cfg.peak_tflops > 0:
        raise UsageError(f"--peak-tflops={cfg.peak_tflops} must be positive (a device's peak "
                         f"TFLOP/s, e.g. 989 for an H100 SXM in bf16)")
    if cfg.wandb is not None and not cfg.wandb.strip():
        raise UsageError("--wandb is empty; name a W&B project, e.g. --wandb zerojax")
    if cfg.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise UsageError("TensorBoard logging (on by default) needs the tensorboardX package: "
                         "pip install tensorboardX, or pass --no-tensorboard")
    if cfg.wandb and importlib.util.find_spec("wandb") is None:
        raise UsageError(f"--wandb {cfg.wandb} needs the wandb package: pip install "
                         f"'zerojax[wandb]', or drop --wandb")
    if not cfg.out.strip():
        raise UsageError("--out is empty; name a run directory, e.g. --out runs/train")
    resume = cfg.resume or cfg.resume_step is not None
    # A resume takes the saved optimizer (`resume_optimizer`), which only the checkpoint knows.
    optimizer = cfg.optimizer if resume else cfg.optimizer or "adamw"
    return dataclasses.replace(cfg, seq_len=seq_len, resume=resume, optimizer=optimizer)


def check_coordinator(address: str) -> None:
    """`--coordinator` must be HOST:PORT (jax.distributed fails on anything else with an
    IndexError from deep inside it)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 2**16:
        raise UsageError(f"--coordinator={address!r} is not HOST:PORT; give process 0's "
                         f"address and a free port, e.g. --coordinator 10.0.0.1:12355")


def flag(name: str) -> str:
    """The command-line spelling of a TrainConfig field."""
    return name.replace("_", "-")


def check_run_dir(cfg: TrainConfig) -> None:
    """`--out` must be a writable directory (created here), with checkpoints iff `--resume`.

    Runs after the data is loaded, so a bad data file is reported as such, whatever the run
    directory already holds."""
    out = Path(cfg.out)
    _make_writable_dir(out)
    tb = out / "tensorboard"
    if cfg.tensorboard and tb.exists() and not tb.is_dir():
        raise UsageError(f"{str(tb)!r} is a file, where the TensorBoard event files go; move "
                         f"it away or pass --no-tensorboard")
    ckpt = out / CHECKPOINTS
    if ckpt.exists() and not ckpt.is_dir():
        raise UsageError(f"{str(ckpt)!r} is a file, not a checkpoint directory; move it away")
    steps = checkpoint_steps(ckpt)
    if cfg.resume and not steps:
        raise UsageError(f"--resume: no checkpoint in {str(ckpt)!r}; train without --resume "
                         f"first, or point --out at the run")
    if not cfg.resume and steps:
        raise UsageError(f"{cfg.out!r} already holds checkpoints (latest step {max(steps)}); "
                         f"pass --resume to continue it or choose another --out")
    if cfg.resume_step is not None and cfg.resume_step not in steps:
        raise UsageError(f"--resume-step={cfg.resume_step}: no such checkpoint in "
                         f"{str(ckpt)!r}; its steps are {', '.join(map(str, steps))}")
    if cfg.resume:
        check_resume_before_steps(cfg, cfg.resume_step or max(steps))


def check_resume_before_steps(cfg: TrainConfig, start: int) -> None:
    """A resumed run must not start past `--steps`: it would train nothing and say done."""
    if start > cfg.steps:
        raise UsageError(f"--steps={cfg.steps} is below step {start}, where the run in "
                         f"{cfg.out!r} resumes: nothing to train; --steps is the total, so "
                         f"pass more than {start} to train on")


def _make_writable_dir(out: Path) -> None:
    where = not_a_directory(out)
    if where:
        raise UsageError(f"--out {str(out)!r} {where}; name a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):  # access() can say yes where a write fails
            pass
    except OSError as e:
        raise UsageError(f"--out {str(out)!r} is not a writable directory: "
                         f"{e.strerror or e}") from None


def check_split(cfg: TrainConfig, devices: int) -> None:
    """The devices must split into replica × data × model, and the global batch evenly over
    the data-parallel devices (replica × data; a model group sees the same sequences) and the
    micro-batches."""
    m = getattr(cfg, "model_parallel", 1)
    if devices % cfg.replica:
        raise UsageError(f"{devices} devices do not split into --replica={cfg.replica} groups")
    if devices % (cfg.replica * m):
        raise UsageError(f"--model-parallel={m} does not divide the {devices // cfg.replica} "
                         f"devices of {'a replica group' if cfg.replica > 1 else 'the run'}; "
                         f"use a divisor of {devices // cfg.replica}")
    n = devices // m
    what = f"the {n} data-parallel devices" if m > 1 else f"the {n} devices"
    if cfg.batch % n:
        raise UsageError(f"--batch={cfg.batch} is not divisible by {what}; use a multiple of "
                         f"{n}")
    if (cfg.batch // n) % cfg.grad_accum:
        raise UsageError(f"per-device batch {cfg.batch // n} is not divisible by "
                         f"--grad-accum={cfg.grad_accum}; use a --batch that is a multiple of "
                         f"{n * cfg.grad_accum}")


def checkpoint_steps(directory: Path) -> list[int]:
    """The complete (integer-named) step directories of a checkpoint directory.

    Not `checkpoint.steps`: orbax's manager asks jax for the process index, which would start
    the backend before `train.start_runtime` sets the device count."""
    if not directory.is_dir():
        return []
    try:
        return sorted(int(p.name) for p in directory.iterdir()
                      if p.is_dir() and p.name.isdigit())
    except OSError as e:
        raise UsageError(f"cannot list {str(directory)!r}: {e.strerror or e}") from None
