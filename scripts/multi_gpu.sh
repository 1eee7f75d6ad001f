#!/usr/bin/env bash
# zerojax on GPU machines without a scheduler.
#
# One machine, all its GPUs, one process (no jax.distributed needed):
#   scripts/multi_gpu.sh --model gpt2-small --steps 5000
#
# Several machines: run this on every host with the same COORDINATOR (host 0's address and a
# free port) and NUM_PROCESSES, and each host's own PROCESS_ID (0 on the coordinator host):
#   COORDINATOR=10.0.0.1:12355 NUM_PROCESSES=2 PROCESS_ID=0 scripts/multi_gpu.sh ...   # host 0
#   COORDINATOR=10.0.0.1:12355 NUM_PROCESSES=2 PROCESS_ID=1 scripts/multi_gpu.sh ...   # host 1
# Each process drives all GPUs of its host; --out must be a directory every host can write
# (a shared file system): each host writes its own checkpoint shards, host 0 the metrics.
#
# Options are passed to `zerojax train` and override the defaults below. PYTHON
# defaults to the project's .venv/bin/python when it exists, else python3.
# Not runnable on the CPU machine this repository is developed on.
set -euo pipefail
venv="$(dirname "$0")/../.venv/bin/python"
[[ -x $venv ]] || venv=python3
PYTHON=${PYTHON:-$venv}

dist=()
if [[ -n ${COORDINATOR:-} ]]; then
  dist=(--coordinator "$COORDINATOR" --num-processes "${NUM_PROCESSES:?set NUM_PROCESSES}"
        --process-id "${PROCESS_ID:?set PROCESS_ID}")
fi

exec "$PYTHON" -m zerojax train \
  --model gpt2-small --stage 3 --param-dtype bfloat16 --batch 64 --seq-len 1024 \
  --steps 5000 --warmup 200 --lr 6e-4 --save-every 500 --eval-every 250 --xla-overlap \
  --out "${OUT:-runs/gpu}" "${dist[@]}" "$@"
