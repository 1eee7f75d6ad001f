"""`python -m zerojax sample`: byte-level text from a checkpoint written by `zerojax train`."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Annotated

import numpy as np
import tyro

from zerojax.app.options import CHECKPOINTS, UsageError, checkpoint_steps
from zerojax.app.recipe import make_optimizer
from zerojax.app.resume import intact_hint, saved_config
from zerojax.errors import CheckpointError, ZeroError


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    """Generate byte-level text from a checkpoint written by `python -m zerojax train`."""

    checkpoint: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="CHECKPOINT")]
    """The run directory (--out of train) or its checkpoints/ directory."""
    prompt: str = "def "
    """Text the generation continues."""
    tokens: int = 200
    """Bytes to generate."""
    temperature: float = 0.8
    """Sampling temperature; 0 picks the most likely byte."""
    step: int | None = None
    """Checkpoint step (default: the latest)."""
    seed: int = 0
    """Sampling seed."""


def sample_main(argv: list[str] | None = None) -> int:
    """`python -m zerojax sample CHECKPOINT [--prompt TEXT] ...`; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = tyro.cli(SampleConfig, args=argv, prog="python -m zerojax sample")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    try:
        text = sample(args)
    except (UsageError, ZeroError, FileNotFoundError) as e:
        print(f"zerojax sample: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(text + "\n")
    return 0


def sample(args: SampleConfig) -> str:
    """The prompt followed by `args.tokens` sampled bytes."""
    if not args.checkpoint.strip():
        raise UsageError("CHECKPOINT is empty; pass a train --out directory")
    if args.tokens < 0 or args.seed < 0 or not (math.isfinite(args.temperature)
                                                  and args.temperature >= 0):
        raise UsageError(f"--tokens={args.tokens}, --temperature={args.temperature} and "
                         f"--seed={args.seed} must be non-negative (and finite)")
    directory = Path(args.checkpoint)
    if (directory / CHECKPOINTS).is_dir():
        directory = directory / CHECKPOINTS
    if not checkpoint_steps(directory):
        raise UsageError(f"no checkpoint in {str(directory)!r}; pass a train --out directory")
    try:
        return _sample(args, directory)
    except CheckpointError as e:
        raise CheckpointError(intact_hint(e, "--step", "sample")) from None


def _sample(args: SampleConfig, directory: Path) -> str:
    import jax

    from zerojax import checkpoint
    from zerojax.engine import Engine
    from zerojax.mesh import make_mesh
    from zerojax.models import get_model

    meta = checkpoint.read_metadata(directory, args.step)
    saved = meta.get("extra", {}).get("train_config")
    if not saved:
        raise UsageError(f"{str(directory)!r} was not written by `zerojax train` (no "
                         f"train_config in its metadata)")
    cfg = saved_config(saved)
    model = get_model(cfg.model)
    engine = Engine(model, make_optimizer(cfg)[0], make_mesh(data=1, devices=jax.devices()[:1]))
    params = engine.params(engine.restore(directory, args.step))  # stays on device
    prompt = args.prompt.encode() or b"\n"
    if max(prompt) >= model.cfg.vocab_size:
        raise UsageError(f"the prompt has bytes >= the vocab_size of preset {cfg.model!r}, "
                         f"{model.cfg.vocab_size}")
    out = generate(model, params, list(prompt), args.tokens, args.temperature, args.seed)
    return bytes(out).decode("utf-8", errors="replace")


def generate(model, params, tokens: list[int], n: int, temperature: float,
             seed: int = 0) -> list[int]:
    """`tokens` extended by `n` bytes sampled from `model` (window: its context length)."""
    import jax

    T = model.cfg.seq_len
    vocab = min(model.cfg.vocab_size, 256)  # byte-level text: ids past 255 are not bytes
    logits_at = jax.jit(lambda p, x_1xT, i: model.apply(p, x_1xT)[0, i, :vocab])
    rng = np.random.default_rng(seed)
    tokens = list(tokens)
    for _ in range(n):
        ctx = tokens[-T:]
        x = np.zeros((1, T), np.int32)
        x[0, :len(ctx)] = ctx  # causal: the zeros after the context do not change its logits
        logits = np.asarray(logits_at(params, x, len(ctx) - 1), np.float64)
        if temperature == 0:
            tokens.append(int(np.argmax(logits)))
            continue
        p = np.exp((logits - logits.max()) / temperature)
        tokens.append(int(rng.choice(vocab, p=p / p.sum())))
    return tokens
