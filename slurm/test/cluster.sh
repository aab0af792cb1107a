#!/usr/bin/env bash
# Starts a one-node SLURM cluster on this machine (CPU-only partition `cpu`), from Debian's
# slurm-wlm and munge, installed when missing: munged, slurmctld and slurmd with
# ProctrackType=proctrack/linuxproc and TaskPlugin=task/none (no cgroups needed, so it runs in a
# container too). Needs root. Idempotent: a running cluster is left as it is.
#
#   bash slurm/test/cluster.sh          # start
#   bash slurm/test/cluster.sh stop     # stop the daemons
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then
  echo "cluster.sh: run as root (it installs packages and starts daemons)" >&2
  exit 1
fi
if [ "${1:-start}" = stop ]; then
  pkill -x slurmd || true
  pkill -x slurmctld || true
  pkill -x munged || true
  exit 0
fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  echo "installing slurm-wlm and munge (Debian packages)" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi

node=$(hostname -s)
cpus=$(nproc)
memory=$(awk '/MemTotal/ { print int($2 / 1024 * 0.9) }' /proc/meminfo)
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
chown slurm: /var/spool/slurmctld /var/log/slurm
chown munge: /run/munge
[ -s /etc/munge/munge.key ] || { mungekey --create --force >/dev/null 2>&1 || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; }
chown munge: /etc/munge/munge.key
chmod 400 /etc/munge/munge.key

cat > /etc/slurm/slurm.conf <<EOF
# One-node test cluster written by aam-rs slurm/test/cluster.sh.
ClusterName=aamtest
SlurmctldHost=$node
SlurmUser=slurm
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
JobRequeue=1
ReturnToService=2
KillWait=30
SlurmctldTimeout=30
SlurmdTimeout=30
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$node CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=cpu Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF

pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd
for _ in $(seq 60); do
  state=$(sinfo -h -n "$node" -o %t 2>/dev/null || true)
  case "$state" in
    idle|mix|alloc) echo "SLURM up: node $node ($cpus CPUs, $memory MB), partition cpu"; exit 0 ;;
    down*|drain*) scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true ;;
  esac
  sleep 1
done
echo "cluster.sh: the node did not become idle; see /var/log/slurm/" >&2
sinfo >&2 || true
exit 1
