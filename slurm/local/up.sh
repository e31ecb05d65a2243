#!/usr/bin/env bash
# Bring up a real SLURM cluster on this machine (munged + slurmctld + a slurmd per node) for tests
# and for trying the sbatch templates on a laptop. Idempotent: if the daemons this script started
# are still alive and the nodes answer, it only prints the export line again.
#
#   bash slurm/local/up.sh            # installs slurm-wlm + munge with apt-get if missing
#   source /tmp/rlinf_hpc-slurm/env.sh   # or: export SLURM_CONF=... as printed
#   sbatch slurm/single_node.sbatch configs/hello.toml
#   bash slurm/local/down.sh          # stops exactly the daemons started here (by pid)
#
# State lives in $RLINF_SLURM_DIR (default /tmp/rlinf_hpc-slurm). No cgroups: processes are
# tracked with proctrack/linuxproc, tasks are not bound (task/none). Node node0 advertises 8 CPUs
# so that 5-rank test jobs fit on a 2-core box.
#
# Partition `het` (not the default) holds two more nodes on this same machine, `het-cpu` and
# `het-gpu` (a slurmd each, on their own ports; 4 CPUs, no GPUs), so that a heterogeneous job can
# run here: SLURM starts a hetjob only when each part gets its own resources, and on the one node
# of `debug` its backfill planned the second part only after the first had ended (both wanting
# that node: the job stayed pending). `sbatch -p het -w het-cpu ... : -p het -w het-gpu ...`.
# RLINF_SLURM_HET=0 leaves them out.
set -euo pipefail

DIR=${RLINF_SLURM_DIR:-/tmp/rlinf_hpc-slurm}
CPUS=${RLINF_SLURM_CPUS:-8}
CONF=$DIR/slurm.conf
HET=${RLINF_SLURM_HET:-1}
SLURMD_PORT=${RLINF_SLURMD_PORT:-6818}
NODES=(node0)
[ "$HET" = 1 ] && NODES+=(het-cpu het-gpu)

log() { printf '[slurm-local] %s\n' "$*" >&2; }

# a recorded pid that runs (an exited daemon nobody reaped is a zombie: kill -0 still answers)
alive() {
    [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null \
        && ! grep -qs '^State:[[:space:]]*Z' "/proc/$(cat "$1")/status"
}

# every node's slurmd (pid files slurmd, slurmd-het-cpu, slurmd-het-gpu) alive
slurmds_alive() {
    local node
    for node in "${NODES[@]}"; do alive "$DIR/pids/$(slurmd_pidfile "$node")" || return 1; done
}
slurmd_pidfile() { [ "$1" = node0 ] && echo slurmd || echo "slurmd-$1"; }

# every node answers idle (or runs jobs): one line per node
nodes_up() {
    local states
    states=$(sinfo -h -N -o %T 2>/dev/null) || return 1
    [ "$(grep -cE '^(idle|mix|alloc)' <<<"$states")" -ge "${#NODES[@]}" ]
}

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurm-wlm and munge with apt-get (needs root and Debian's mirrors)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq slurm-wlm munge >/dev/null
fi

if alive "$DIR/pids/munged" && alive "$DIR/pids/slurmctld" && slurmds_alive \
    && SLURM_CONF=$CONF nodes_up; then
    log "already up (state in $DIR)"
    echo "export SLURM_CONF=$CONF"
    exit 0
fi
# Some of this cluster's daemons alive but not all of them answering (one died, or an older
# up.sh started them with another node list): the config is written anew below, so stop them all
RLINF_SLURM_DIR=$DIR bash "$(dirname "$0")/down.sh"

# Another local cluster (another RLINF_SLURM_DIR: a developer's beside CI's) holds the same
# ports: our daemons would fail to bind and our jobs would run on its node, with its config.
others=$(pgrep -a -x 'slurmctld|slurmd' 2>/dev/null | grep -v -- " -f $CONF" || true)
if [ -n "$others" ] && [ -z "${RLINF_SLURMCTLD_PORT:-}${RLINF_SLURMD_PORT:-}" ]; then
    log "other SLURM daemons run on this machine (not from $DIR), on the ports this cluster"
    log "needs (${RLINF_SLURMCTLD_PORT:-6817}/$SLURMD_PORT and up):"
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
# Every node is this machine (one slurmd per node, each started with -N NAME). A node named
# `localhost` takes this machine's hostname in slurmctld's eyes, which it then refused as a
# duplicate of the others' ("Duplicated NodeHostName"): the nodes name the hostname themselves.
HOST=$(hostname)

cat >"$CONF" <<CONF
ClusterName=local
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCK
SlurmctldPort=${RLINF_SLURMCTLD_PORT:-6817}
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/state/slurmctld.pid
SlurmdPidFile=$DIR/state/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# hetjobs start only from a backfill cycle (default: every 30 s); each node has its own Port
SchedulerParameters=bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
MailProg=/bin/true
FirstJobId=$FIRST_JOB_ID
NodeName=node0 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$SLURMD_PORT CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=node0 Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
if [ "$HET" = 1 ]; then
    cat >>"$CONF" <<CONF
NodeName=het-cpu NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + 10)) CPUs=4 Boards=1 SocketsPerBoard=1 CoresPerSocket=4 ThreadsPerCore=1 RealMemory=4000 Feature=cpu State=UNKNOWN
NodeName=het-gpu NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + 11)) CPUs=4 Boards=1 SocketsPerBoard=1 CoresPerSocket=4 ThreadsPerCore=1 RealMemory=4000 Feature=gpu State=UNKNOWN
PartitionName=het Nodes=het-cpu,het-gpu MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
fi
mkdir -p "$DIR/spool"

export SLURM_CONF=$CONF
if ! alive "$DIR/pids/slurmctld"; then
    setsid slurmctld -D -i -f "$CONF" </dev/null >>"$DIR/log/slurmctld.out" 2>&1 &
    echo $! >"$DIR/pids/slurmctld"
fi
for node in "${NODES[@]}"; do  # several slurmd on one machine: each its node's name (-N)
    pidfile=$DIR/pids/$(slurmd_pidfile "$node")
    if ! alive "$pidfile"; then
        setsid slurmd -D -N "$node" -f "$CONF" </dev/null >>"$DIR/log/slurmd-$node.out" 2>&1 &
        echo $! >"$pidfile"
    fi
done

deadline=$((SECONDS + 30))
while [ $SECONDS -lt $deadline ]; do
    for daemon in slurmctld $(for n in "${NODES[@]}"; do slurmd_pidfile "$n"; done); do
        alive "$DIR/pids/$daemon" && continue
        log "$daemon exited at start; its log:"
        tail -n 5 "$DIR/log/$daemon.out" "$DIR/log/$daemon-node0.out" 2>/dev/null | sed 's/^/[slurm-local]   /' >&2
        exit 1
    done
    nodes_up && break
    if sinfo -h -N -o %T 2>/dev/null | grep -qE '^(down|drain)'; then
        scontrol update NodeName="$(IFS=,; echo "${NODES[*]}")" State=RESUME >/dev/null 2>&1 || true
    fi
    sleep 0.2
done
if ! nodes_up; then
    states=$(sinfo -h -N -o '%N %T' 2>/dev/null | tr '\n' ' ' || true)
    log "nodes not idle after 30 s (${states:-no answer}); logs in $DIR/log"
    exit 1
fi

log "up: node node0 ($CPUS CPUs)$([ "$HET" = 1 ] && echo ", partition het: het-cpu, het-gpu (4 CPUs each)"), state in $DIR"
echo "export SLURM_CONF=$CONF" | tee "$DIR/env.sh"
