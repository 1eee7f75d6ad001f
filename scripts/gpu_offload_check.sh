#!/usr/bin/env bash
# Offload's GPU checks as one prepared command for a lent device: the step of plain optax,
# offload, offload with the delayed update and Twin-Flow (0.4 of the state on the host), with
# and without the delay, on the 1b preset; the largest GPT that steps with offload against
# `plan --largest`'s prediction; where an offloaded step's time goes; the host update of the
# 1b preset's largest leaf with its state over 1, 2, 4 and 8 CPU devices; the host and device
# memory of a save and a restore; a resume's (a restore in a fresh process), with glibc's
# malloc as it is and with its mmap threshold fixed at 16 MiB. The parts run in that order,
# most important first, each under its own time limit and all within --budget seconds: a part
# that would start with under 30 s left is skipped and named. Writes OUT/ (default
# runs/offload_check) and, with --pack DIR (the device tool's $OUT), puts there one gzipped tar
# of OUT and the report files.
#
#   usage: scripts/gpu_offload_check.sh [--out DIR] [--budget S] [--pack DIR] [--preset P]
#                                       [--batch B] [--dry-run] [PART ...]
#   parts: bench largest phases update ckpt resume resume-mmap (default: all, in that order; the
#          resumes read the step the ckpt part keeps in $TMPDIR, which a run with a resume
#          part deletes at its end)
#   e.g.   scripts/gpu_offload_check.sh --budget 420 --pack "$OUT"
#          scripts/gpu_offload_check.sh --budget 270 --pack "$OUT" phases update  # the next
#
# Environment: PYTHON (as scripts/gpu_bench.sh), HOST_MEMORY (bytes for plan's estimate;
# default: the machine's), PINNED_LIMIT_GB (XLA:GPU's pinned-host pool; default 110).
# --dry-run prints each part's command and runs nothing (tests/test_bench.py parses them).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.venv/bin/python"
[[ -x $venv ]] || venv=python3
PYTHON=${PYTHON:-$venv}
out=runs/offload_check budget=540 pack="" preset=1b batch=8 dry=0 parts=()
while (($#)); do
    case $1 in
        --out) out=$2; shift 2 ;;
        --budget) budget=$2; shift 2 ;;
        --pack) pack=$2; shift 2 ;;
        --preset) preset=$2; shift 2 ;;
        --batch) batch=$2; shift 2 ;;
        --dry-run) dry=1; shift ;;
        bench|largest|phases|update|ckpt|resume|resume-mmap) parts+=("$1"); shift ;;
        *) echo "gpu_offload_check.sh: unknown argument '$1' (see the usage at its top)" >&2
           exit 2 ;;
    esac
done
((${#parts[@]})) || parts=(bench largest phases update ckpt resume resume-mmap)
((dry)) || mkdir -p "$out"

# Each part's time limit in seconds, and its command (`cmd`) for a limit of $2 seconds: the
# children of gpu_bench.py (the whole bench; each probe of the search) stop 10 s before it.
declare -A limits=([bench]=270 [largest]=240 [phases]=150 [update]=120 [ckpt]=150
                   [resume]=75 [resume-mmap]=75)
ckpt_dir="${TMPDIR:-/tmp}/zerojax-offload-check-ckpt"  # not under OUT: --pack tars OUT
command_of() {
    local bench=("$PYTHON" "$root/experiments/gpu_bench.py" --out "$out" --preset "$preset")
    case $1 in
        bench) cmd=("${bench[@]}" --batch "$batch" --repeats 5 --steps-per-repeat 1 --parts bench
               --variants stage3_offload stage3_offload_dpu stage3_twin stage3_twin_dpu
               --timeout $(($2 - 10))) ;;
        largest) cmd=("${bench[@]}" --parts largest --largest-variants stage3_offload
                 --pinned-limit-gb "${PINNED_LIMIT_GB:-110}" --timeout $(($2 - 10))
                 ${HOST_MEMORY:+--host-memory "$HOST_MEMORY"}) ;;
        phases) cmd=("$PYTHON" "$root/experiments/offload_phases.py" --preset "$preset"
                --batch "$batch" --out "$out/phases.json") ;;
        # the 1b preset's largest leaf: its MLP kernels stacked over 16 layers, 302 M params
        update) cmd=("$PYTHON" "$root/experiments/update_bench.py" --params 302e6
                --host-devices 1 2 4 8 --repeats 5 --out "$out/update.json") ;;
        ckpt) cmd=("$PYTHON" "$root/experiments/offload_checkpoint_memory.py" --preset "$preset"
              --dir "$ckpt_dir" --out "$out/ckpt.json") ;;
        resume) cmd=("$PYTHON" "$root/experiments/offload_checkpoint_memory.py" --preset "$preset"
                --restore-only "$ckpt_dir/b" --out "$out/resume.json") ;;
        resume-mmap) cmd=("$PYTHON" "$root/experiments/offload_checkpoint_memory.py" --preset
                     "$preset" --restore-only "$ckpt_dir/b" --mmap-threshold $((16 << 20))
                     --out "$out/resume_mmap.json") ;;
    esac
}

start=$SECONDS skipped=()
for part in "${parts[@]}"; do
    limit=${limits[$part]}
    if ((dry)); then command_of "$part" "$limit"; printf '%s\n' "$part: ${cmd[*]}"; continue; fi
    left=$((budget - (SECONDS - start)))
    if ((left < 30)); then skipped+=("$part"); continue; fi
    ((limit < left)) || limit=$left
    command_of "$part" "$limit"
    [[ $part == ckpt ]] && rm -rf "$ckpt_dir"  # a fresh one
    echo "== $part (at most ${limit} s; ${left} s of the budget left)" >&2
    rc=0
    timeout --kill-after=10 "$limit" "${cmd[@]}" >"$out/$part.out" 2>"$out/$part.err" || rc=$?
    echo "== $part: exit $rc after $((SECONDS - start)) s" >&2
    tail -n 25 "$out/$part.out" >&2
done
((dry)) && exit 0
# the resumes' step (the 1b preset's two steps: ~30 GB) is kept for a later call's resumes
[[ " ${parts[*]} " == *" resume"* ]] && rm -rf "$ckpt_dir"
((${#skipped[@]} == 0)) || echo "skipped for lack of time: ${skipped[*]} (run them again)" >&2
if [[ -n $pack ]]; then
    mkdir -p "$pack"
    tar czf "$pack/offload_check.tgz" -C "$out" .
    for f in gpu_bench.md phases.json update.json ckpt.json resume.json resume_mmap.json; do
        [[ -f $out/$f ]] && cp "$out/$f" "$pack/"
    done
fi
exit 0
