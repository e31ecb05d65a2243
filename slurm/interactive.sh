#!/bin/bash
# Run a config interactively: get an allocation with salloc and start the ranks with srun in it.
# Inside an existing allocation (salloc shell), it only runs srun.
#
#   bash slurm/interactive.sh configs/hello.toml                 # 4 tasks
#   bash slurm/interactive.sh -n 8 -t 01:00:00 -p gpu configs/hello.toml --set hello.num_items=64
#
# Options before CONFIG: -n TASKS (default 4), -t TIME (default 00:30:00), -p PARTITION,
# -g GPUS_PER_TASK. Anything after CONFIG goes to `rlinf-hpc run`.
set -euo pipefail

TASKS=4
TIME=00:30:00
EXTRA=()
while getopts "n:t:p:g:h" opt; do
    case $opt in
        n) TASKS=$OPTARG ;;
        t) TIME=$OPTARG ;;
        p) EXTRA+=(--partition="$OPTARG") ;;
        g) EXTRA+=(--gpus-per-task="$OPTARG") ;;
        *) sed -n '2,10p' "$0" >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
if [ $# -lt 1 ]; then
    sed -n '2,10p' "$0" >&2
    exit 2
fi

RLINF_HPC=${RLINF_HPC:-rlinf-hpc}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
STEP=(srun --mpi=pmi2 --kill-on-bad-exit=1 "$RLINF_HPC" run "$@")

if [ -n "${SLURM_JOB_ID:-}" ]; then
    # Already inside salloc/sbatch: use this allocation's tasks.
    exec "${STEP[@]}"
fi
exec salloc --ntasks="$TASKS" --time="$TIME" "${EXTRA[@]}" "${STEP[@]}"
