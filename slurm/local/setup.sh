#!/usr/bin/env bash
# Installs, configures and starts a single-node Slurm on this machine (Debian's slurm-wlm and munge,
# as root, no systemd, no cgroups, no slurmdbd), for pipespec_mpi's Slurm tests and local tries.
# Idempotent: when the node is already up with this configuration it only checks.
#
#   bash slurm/local/setup.sh           install if needed, (re)configure, start, wait for the node
#   bash slurm/local/setup.sh --stop    stop the daemons this script started (by their pid files)
#   bash slurm/local/setup.sh --status  print sinfo and exit 0 if the node is usable
#
# Knobs (environment): SLURM_LOCAL_CPUS (128) and SLURM_LOCAL_GPUS (64) are what the node
# advertises (more than the machine has, on purpose: the jobs are tiny, and the sbatch scripts'
# defaults must fit; the GPUs are counted only, there is no CUDA device behind them),
# SLURM_LOCAL_PARTITION (debug), SLURM_LOCAL_STATE (/var/lib/pipespec-slurm),
# SLURM_LOCAL_WAIT_S (60, how long to wait for the node), SLURM_LOCAL_FORCE=1 to overwrite an
# /etc/slurm/slurm.conf that this script did not write.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
GRES=$CONF_DIR/gres.conf
MARK="ClusterName=pipespec-local"
NODE=$(hostname -s)
CPUS=${SLURM_LOCAL_CPUS:-128}
GPUS=${SLURM_LOCAL_GPUS:-64}
PARTITION=${SLURM_LOCAL_PARTITION:-debug}
STATE=${SLURM_LOCAL_STATE:-/var/lib/pipespec-slurm}
LOGDIR=/var/log/slurm
WAIT_S=${SLURM_LOCAL_WAIT_S:-60}

log() { echo "[slurm/local] $*"; }
die() {
  echo "[slurm/local] ERROR: $*" >&2
  exit 1
}

alive() { # alive PIDFILE: the process named in the pid file runs
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

stop_daemon() { # stop_daemon NAME PIDFILE
  if alive "$2"; then
    local pid
    pid=$(cat "$2")
    log "stopping $1 (pid $pid)"
    kill "$pid" || true
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.2
    done
    if kill -0 "$pid" 2>/dev/null; then
      kill -9 "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$2"
}

node_state() { sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -n1 || true; }

usable() { # the node takes jobs (a trailing * means slurmd has not answered yet)
  case "$(node_state)" in
    *\*) return 1 ;;
    idle* | mixed* | allocated* | completing*) return 0 ;;
    *) return 1 ;;
  esac
}

case "${1:-}" in
  --stop)
    stop_daemon slurmd "$STATE/slurmd.pid"
    stop_daemon slurmctld "$STATE/slurmctld.pid"
    exit 0
    ;;
  --status)
    sinfo 2>&1 || true
    usable
    exit $?
    ;;
  "") ;;
  *) die "unknown argument $1 (use --stop or --status)" ;;
esac

# ------------------------------------------------------------------ install
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null ||
  ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
  [ "$(id -u)" = 0 ] || die "Slurm is not installed and installing it needs root"
  command -v apt-get >/dev/null || die "Slurm is not installed and there is no apt-get here"
  log "installing slurm-wlm and munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi
[ "$(id -u)" = 0 ] || die "the local Slurm runs as root; run this script as root"

# ------------------------------------------------------------------ munge
if [ ! -s /etc/munge/munge.key ]; then
  log "creating /etc/munge/munge.key"
  mkdir -p /etc/munge
  if command -v mungekey >/dev/null; then
    mungekey --create --keyfile=/etc/munge/munge.key
  else
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
fi
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "starting munged"
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge
  chmod 0755 /run/munge
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break
    sleep 0.1
  done
  munge -n | unmunge >/dev/null || die "munged does not answer (see /var/log/munge/munged.log)"
fi

# ------------------------------------------------------------------ configuration
if [ -e "$CONF" ] && ! grep -q "^$MARK" "$CONF" && [ "${SLURM_LOCAL_FORCE:-0}" != 1 ]; then
  die "$CONF exists and was not written by this script; set SLURM_LOCAL_FORCE=1 to replace it"
fi
MEM_MB=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
render() { # render TEMPLATE
  sed -e "s|@NODE@|$NODE|g" -e "s|@CPUS@|$CPUS|g" -e "s|@GPUS@|$GPUS|g" \
    -e "s|@PARTITION@|$PARTITION|g" -e "s|@STATE@|$STATE|g" -e "s|@LOGDIR@|$LOGDIR|g" \
    -e "s|@MEM_MB@|$MEM_MB|g" -e "s|@LAST_GPU@|$((GPUS - 1))|g" "$1"
}
[ "$GPUS" -ge 1 ] || die "SLURM_LOCAL_GPUS must be >= 1"
mkdir -p "$CONF_DIR" "$STATE/slurmctld" "$STATE/slurmd" "$STATE/fake-gpu" "$LOGDIR"
for ((i = 0; i < GPUS; i++)); do
  [ -e "$STATE/fake-gpu/nvidia$i" ] || : >"$STATE/fake-gpu/nvidia$i"
done
changed=0
for pair in "slurm.conf.in:$CONF" "gres.conf.in:$GRES"; do
  src=$HERE/${pair%%:*}
  dst=${pair#*:}
  if ! cmp -s <(render "$src") "$dst"; then
    render "$src" >"$dst.tmp"
    mv "$dst.tmp" "$dst"
    changed=1
  fi
done
if [ "$changed" = 1 ]; then
  log "wrote $CONF and $GRES (node $NODE: $CPUS CPUs, $GPUS GPUs, partition $PARTITION)"
  stop_daemon slurmd "$STATE/slurmd.pid"
  stop_daemon slurmctld "$STATE/slurmctld.pid"
fi

# ------------------------------------------------------------------ daemons
if ! alive "$STATE/slurmctld.pid"; then
  log "starting slurmctld"
  # -i: ignore state files from an older configuration instead of refusing to start.
  slurmctld -i || die "slurmctld did not start (see $LOGDIR/slurmctld.log)"
fi
if ! alive "$STATE/slurmd.pid"; then
  log "starting slurmd"
  slurmd -N "$NODE" || die "slurmd did not start (see $LOGDIR/slurmd.log)"
fi

deadline=$((SECONDS + WAIT_S))
resumed=0
until usable; do
  state=$(node_state)
  case "$state" in
    inval*)
      sinfo -N -o '%N %T %E' >&2 || true
      die "slurmctld rejected node $NODE's registration (see $LOGDIR/slurmctld.log)"
      ;;
    down* | drain*)
      if [ "$resumed" = 0 ]; then
        log "node $NODE is $state: resuming it"
        scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true
        resumed=1
      fi
      ;;
  esac
  if [ "$SECONDS" -ge "$deadline" ]; then
    sinfo -N -l >&2 || true
    tail -n 20 "$LOGDIR/slurmctld.log" "$LOGDIR/slurmd.log" >&2 || true
    die "node $NODE not usable after ${WAIT_S}s (state: ${state:-unknown})"
  fi
  sleep 0.5
done
log "Slurm is up: $(sinfo -h -o '%P %a %D %T %c CPUs %G')"
