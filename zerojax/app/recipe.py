"""The run a `TrainConfig` describes (options.py): its tokens (`load_data`), and its
optimizer (app/presets.py) with the learning-rate schedule, or a resumed run's (`make_optimizer`,
`resume_optimizer`). Nothing here starts jax's backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from zerojax.app.data import check_ids, embedded_corpus, load_tokens, split_tokens
from zerojax.app.options import TrainConfig, UsageError
from zerojax.models import PRESETS


def load_data(cfg: TrainConfig) -> tuple[np.ndarray, np.ndarray, str]:
    """`(train, eval, description)` tokens: the embedded corpus or `--data`."""
    if cfg.data is None:
        train, ev = embedded_corpus(split="train"), embedded_corpus(split="eval")
        what = "embedded stdlib corpus"
    else:
        train, ev = split_tokens(load_tokens(cfg.data))
        what = cfg.data
    vocab = PRESETS[cfg.model].vocab_size
    # A prefix of a large memory-mapped file, to keep start-up fast.
    whose = f" (preset {cfg.model!r} has vocab_size {vocab})"
    check_ids(train[:ID_CHECK], vocab, what, whose=whose)
    check_ids(ev[:ID_CHECK], vocab, what, offset=len(train), whose=whose)
    for split, t in (("train", train), ("eval", ev)):
        if len(t) <= cfg.seq_len:
            raise UsageError(f"{what}: {len(t)} {split} tokens are too few for --seq-len="
                             f"{cfg.seq_len}")
    return train, ev, f"{what}: {len(train):,} train / {len(ev):,} eval tokens"


ID_CHECK = 2**26  # tokens of each split whose ids are checked before training


def make_schedule(cfg: TrainConfig):
    """Linear warm-up to --lr, then cosine decay to --min-lr-ratio × --lr at --steps (or
    constant)."""
    import optax

    w, lr = cfg.warmup, cfg.lr
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=lr / w if w else lr, peak_value=lr, warmup_steps=w,
            decay_steps=max(cfg.steps, w + 1), end_value=lr * cfg.min_lr_ratio)
    return optax.join_schedules(
        [optax.linear_schedule(lr / w if w else lr, lr, w), optax.constant_schedule(lr)], [w])


def make_optimizer(cfg: TrainConfig):
    """The `--optimizer` preset (`zerojax.app.presets.build`) with linear warm-up then
    cosine (or constant); returns (optimizer, schedule)."""
    from zerojax.app.presets import build

    schedule = make_schedule(cfg)
    return build(cfg.optimizer or "adamw", schedule, weight_decay=cfg.weight_decay), schedule


def resume_optimizer(cfg: TrainConfig, saved: dict[str, Any]) -> TrainConfig:
    """`cfg` with the optimizer of the run it resumes (`saved`: the checkpoint's train_config;
    runs from before --optimizer used adamw): a resume continues the saved optimizer state, so
    another `--optimizer` is refused."""
    was = (saved.get("optimizer") or "adamw") if saved else cfg.optimizer or "adamw"
    if cfg.optimizer is not None and cfg.optimizer != was:
        raise UsageError(f"--optimizer {cfg.optimizer}: the run in {cfg.out!r} was trained with "
                         f"--optimizer {was}, whose state {cfg.optimizer} cannot continue; "
                         f"resume without --optimizer (or with --optimizer {was}), or start a "
                         f"new run in another --out")
    return dataclasses.replace(cfg, optimizer=was)
