#!/usr/bin/env bash
# Stop exactly the daemons that slurm/local/up.sh started (by the pids it recorded), then leave
# the state directory in place for inspection. Safe to run twice.
set -uo pipefail
DIR=${RLINF_SLURM_DIR:-/tmp/rlinf_hpc-slurm}
for name in slurmd-het-gpu slurmd-het-cpu slurmd slurmctld munged; do
    pidfile=$DIR/pids/$name
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
        printf '[slurm-local] stopped %s (pid %s)\n' "$name" "$pid" >&2
    fi
    rm -f "$pidfile"
done
