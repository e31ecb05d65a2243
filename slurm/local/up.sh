#!/usr/bin/env bash
# Bring up a real single-node SLURM cluster (munged + slurmctld + slurmd on localhost) for tests
# and for trying the sbatch templates on a laptop. Idempotent: if the daemons this script started
# are still alive and the node answers, it only prints the export line again.
#
#   bash slurm/local/up.sh            # installs slurm-wlm + munge with apt-get if missing
#   source /tmp/rlinf_hpc-slurm/env.sh   # or: export SLURM_CONF=... as printed
#   sbatch slurm/single_node.sbatch configs/hello.toml
#   bash slurm/local/down.sh          # stops exactly the daemons started here (by pid)
#
# State lives in $RLINF_SLURM_DIR (default /tmp/rlinf_hpc-slurm). No cgroups: processes are
# tracked with proctrack/linuxproc, tasks are not bound (task/none). The node advertises 8 CPUs
# so that 5-rank test jobs fit on a 2-core box.
set -euo pipefail

DIR=${RLINF_SLURM_DIR:-/tmp/rlinf_hpc-slurm}
CPUS=${RLINF_SLURM_CPUS:-8}
CONF=$DIR/slurm.conf

log() { printf '[slurm-local] %s\n' "$*" >&2; }

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurm-wlm and munge with apt-get (needs root and Debian's mirrors)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq slurm-wlm munge >/dev/null
fi

if alive "$DIR/pids/munged" && alive "$DIR/pids/slurmctld" && alive "$DIR/pids/slurmd" \
    && SLURM_CONF=$CONF sinfo -h -o %T 2>/dev/null | grep -qE 'idle|mix|alloc'; then
    log "already up (state in $DIR)"
    echo "export SLURM_CONF=$CONF"
    exit 0
fi

# Another local cluster (another RLINF_SLURM_DIR: a developer's beside CI's) holds the same
# ports: our daemons would fail to bind and our jobs would run on its node, with its config.
others=$(pgrep -a -x 'slurmctld|slurmd' 2>/dev/null | grep -v -- " -f $CONF" || true)
if [ -n "$others" ] && [ -z "${RLINF_SLURMCTLD_PORT:-}${RLINF_SLURMD_PORT:-}" ]; then
    log "other SLURM daemons run on this machine (not from $DIR), on the ports this cluster"
    log "needs (${RLINF_SLURMCTLD_PORT:-6817}/${RLINF_SLURMD_PORT:-6818}):"
    sed 's/^/[slurm-local]   /' <<<"$others" >&2
    log "stop them first (RLINF_SLURM_DIR=<their dir> bash slurm/local/down.sh), or give this one"
    log "other ports with RLINF_SLURMCTLD_PORT and RLINF_SLURMD_PORT"
    exit 1
fi

mkdir -p "$DIR"/{state,spool,log,pids,munge}
chmod 755 "$DIR" "$DIR/munge"   # munged insists its socket directory is not group/world writable

if [ ! -s "$DIR/munge/munge.key" ]; then
    mungekey --create --keyfile="$DIR/munge/munge.key"
fi
chmod 600 "$DIR/munge/munge.key"
SOCK=$DIR/munge/munge.socket

if ! alive "$DIR/pids/munged"; then
    rm -f "$SOCK" "$SOCK.lock"
    setsid munged -F --force --key-file="$DIR/munge/munge.key" --socket="$SOCK" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" \
        --seed-file="$DIR/munge/munged.seed" </dev/null >>"$DIR/log/munged.out" 2>&1 &
    echo $! >"$DIR/pids/munged"
    for _ in $(seq 50); do [ -S "$SOCK" ] && break; sleep 0.1; done
    [ -S "$SOCK" ] || { log "munged did not create $SOCK; see $DIR/log/munged.log"; exit 1; }
fi

# Job ids unique across restarts of a fresh cluster (a new state directory starts at 1 again):
# MPICH's shared-memory segments in /dev/shm are named after the job and step, and a segment a
# killed job 1.0 left behind was attached to by the next cluster's job 1.0, whose MPI_Init then
# read stale addresses ("UCX ERROR failed to unpack address, invalid bandwidth 0.00").
FIRST_JOB_ID=$(( ($(date +%s) % 600000) * 100 + 1 ))

cat >"$CONF" <<CONF
ClusterName=local
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCK
SlurmctldPort=${RLINF_SLURMCTLD_PORT:-6817}
SlurmdPort=${RLINF_SLURMD_PORT:-6818}
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/state/slurmctld.pid
SlurmdPidFile=$DIR/state/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
MailProg=/bin/true
FirstJobId=$FIRST_JOB_ID
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF

export SLURM_CONF=$CONF
if ! alive "$DIR/pids/slurmctld"; then
    setsid slurmctld -D -i -f "$CONF" </dev/null >>"$DIR/log/slurmctld.out" 2>&1 &
    echo $! >"$DIR/pids/slurmctld"
fi
if ! alive "$DIR/pids/slurmd"; then
    setsid slurmd -D -N localhost -f "$CONF" </dev/null >>"$DIR/log/slurmd.out" 2>&1 &
    echo $! >"$DIR/pids/slurmd"
fi

for _ in $(seq 150); do
    state=$(sinfo -h -o %T 2>/dev/null || true)
    case "$state" in
        idle*|mix*|alloc*) break ;;
        down*|drain*) scontrol update NodeName=localhost State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 0.2
done
state=$(sinfo -h -o %T 2>/dev/null || true)
case "$state" in
    idle*|mix*|alloc*) ;;
    *) log "node not idle after 30 s (state '${state:-no answer}'); logs in $DIR/log"; exit 1 ;;
esac

log "up: node localhost $state, $CPUS CPUs, state in $DIR"
echo "export SLURM_CONF=$CONF" | tee "$DIR/env.sh"
