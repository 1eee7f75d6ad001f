#!/usr/bin/env bash
# Runs `zerojax train` (with the project's .venv python) as P processes on this machine, over
# loopback (CPU devices, gloo collectives): the same program a multi-host GPU job runs.
#
#   usage: scripts/launch_local.sh P DEVICES_PER_PROCESS [train options...]
#   e.g.   scripts/launch_local.sh 2 2 --model nano --steps 100 --out runs/two-procs
#
# Without --out (or --config), the run goes to runs/launch_local, apart from the quick start's
# runs/train. Environment: PORT (coordinator port, default 12355), PYTHON (default: the
# project's .venv/bin/python when it exists, else python3).
# Ctrl-C reaches every process; each saves its checkpoint shards and exits with 130.
set -uo pipefail

if [[ $# -lt 2 ]]; then
  sed -n '5,6p' "$0" >&2
  exit 2
fi
P=$1
D=$2
shift 2
PORT=${PORT:-12355}
venv="$(dirname "$0")/../.venv/bin/python"
[[ -x $venv ]] || venv=python3
PYTHON=${PYTHON:-$venv}
out=(--out runs/launch_local)
for arg in "$@"; do
  [[ $arg == --out || $arg == --out=* || $arg == --config || $arg == --config=* ]] && out=()
done
export JAX_PLATFORMS=cpu

pids=()
for ((i = 0; i < P; i++)); do
  "$PYTHON" -m zerojax train --devices "$D" --coordinator "127.0.0.1:$PORT" \
    --num-processes "$P" --process-id "$i" "${out[@]}" "$@" &
  pids+=($!)
done
# Background jobs of a script ignore SIGINT until Python installs its own handler: forward it.
trap 'for p in "${pids[@]}"; do [[ -n $p ]] && kill -INT "$p" 2>/dev/null; done' INT TERM

# Poll rather than `wait`: a process that fails would leave the others blocked in a collective
# forever, so the first failure (other than Ctrl-C's 130) stops the rest.
status=0
while true; do
  alive=0
  for i in "${!pids[@]}"; do
    pid=${pids[$i]}
    [[ -z $pid ]] && continue
    if kill -0 "$pid" 2>/dev/null; then
      alive=1
      continue
    fi
    wait "$pid"
    rc=$?
    pids[i]=""
    if [[ $rc -ne 0 && $status -eq 0 ]]; then
      status=$rc
      if [[ $rc -ne 130 ]]; then
        echo "launch_local.sh: process $i exited with $rc; stopping the others" >&2
        for other in "${pids[@]}"; do [[ -n $other ]] && kill -TERM "$other" 2>/dev/null; done
      fi
    fi
  done
  [[ $alive -eq 1 ]] || break
  sleep 1
done
exit "$status"
