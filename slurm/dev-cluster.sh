#!/usr/bin/env bash
# A real Slurm cluster (with accounting) for development and tests, on a Debian/Ubuntu machine
# without systemd, run as root: partition `debug` (default) is this host as one node; partition
# `multi` is two more nodes, <host>-a and <host>-b, emulated on this host by two more slurmd
# (Debian's Slurm is built with multiple-slurmd support), for jobs that span nodes.
#
#   slurm/dev-cluster.sh up       install what is missing, configure, start, wait for the node
#   slurm/dev-cluster.sh down     stop the daemons that `up` started
#   slurm/dev-cluster.sh status   show which daemons run, and sinfo (exit 3 if any is stopped)
#
# Daemons: munged, mariadbd (socket only), slurmdbd, slurmctld, slurmd (x3). Each one is
# recognised by its pid file *and* its process name, never by name alone, so `down`
# cannot hit someone else's process.
#
# Layout: configs in /etc/slurm, logs in /var/log/slurm-dev, pid files in /run/slurm-dev
# (munged and mariadbd keep theirs, named slurm-dev-*.pid, in /run/munge and /run/mysqld,
# which their own users can write), all state (slurmctld, slurmd, MariaDB data) in /var/spool/slurm-dev.
#
# To start from nothing: `down`, then `rm -rf /var/spool/slurm-dev`. Wipe the whole
# directory, not just one part: slurmctld restarts job ids at 1 when its state is gone, and
# the accounting database would then hold two jobs under the same id.
#
# Temporary files: each daemon gets a directory of its own, owned by the user it runs as
# ($SPOOL/tmp/<daemon>), whatever the caller's TMPDIR is: MariaDB runs as mysql and cannot create
# its temporary files in a TMPDIR only root can write.
#
# Environment: DEV_CLUSTER_CPUS (default 16) CPUs the node advertises, more than the machine
# has, so several jobs run side by side; DEV_CLUSTER_TIMEOUT (default 60) seconds to wait
# for each daemon.
set -euo pipefail

CLUSTER=dev
PARTITION=debug
MULTI=multi
CPUS=${DEV_CLUSTER_CPUS:-16}
TIMEOUT=${DEV_CLUSTER_TIMEOUT:-60}
NODE=$(hostname -s)
# The emulated nodes: name and slurmd port (the host's own slurmd keeps the default 6818).
EMULATED=("$NODE-a:6821" "$NODE-b:6822")

ETC=/etc/slurm
LOG_DIR=/var/log/slurm-dev
RUN_DIR=/run/slurm-dev
SPOOL=/var/spool/slurm-dev
DB_DIR=$SPOOL/mysql
DB_SOCK=/run/mysqld/mysqld.sock   # libmariadb's default: slurmdbd has no setting for it
DB_PASS_FILE=$SPOOL/db-password
MARKER="# Written by slurm/dev-cluster.sh"

PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server libpmix2 libpmix-dev)
# Start order; `down` walks it backwards.
DAEMONS=(munged mariadb slurmdbd slurmctld slurmd slurmd_a slurmd_b)

# The node a slurmd daemon serves: slurmd -> this host, slurmd_a -> $NODE-a, ...
node_of() { [[ $1 == slurmd ]] && echo "$NODE" || echo "$NODE-${1#slurmd_}"; }
pidfile_of() {
    case $1 in
        munged) echo /run/munge/slurm-dev-munged.pid ;;
        mariadb) echo /run/mysqld/slurm-dev-mariadbd.pid ;;
        slurmd | slurmd_*) echo "$RUN_DIR/slurmd-$(node_of "$1").pid" ;;
        *) echo "$RUN_DIR/$1.pid" ;;
    esac
}
comm_of() {
    case $1 in
        mariadb) echo mariadbd ;;
        slurmd | slurmd_*) echo slurmd ;;
        *) echo "$1" ;;
    esac
}
user_of() {
    case $1 in
        munged) echo munge ;;
        mariadb) echo mysql ;;
        *) echo root ;;
    esac
}
# The daemon's own temporary directory, created (mode 700, its user's) when missing.
tmpdir_of() {
    local dir=$SPOOL/tmp/$1 user
    user=$(user_of "$1")
    install -d -m 755 "$SPOOL/tmp"
    install -d -m 700 -o "$user" -g "$user" "$dir"
    echo "$dir"
}
logfile_of() {
    case $1 in
        slurmd | slurmd_*) echo "$LOG_DIR/slurmd-$(node_of "$1").log" ;;
        *) echo "$LOG_DIR/$1.log" ;;
    esac
}

T0=${EPOCHREALTIME/./}
say() {
    local tenths=$(((${EPOCHREALTIME/./} - T0) / 100000))
    printf 'dev-cluster [%3d.%ds] %s\n' $((tenths / 10)) $((tenths % 10)) "$*"
}
die() { echo "dev-cluster: ERROR: $*" >&2; exit 1; }

# Fail with the tail of the daemon logs that explain it.
die_with_logs() {
    local msg=$1 name; shift
    {
        echo "dev-cluster: ERROR: $msg"
        for name in "$@"; do
            echo "---- last lines of $(logfile_of "$name") ----"
            tail -n 25 "$(logfile_of "$name")" 2>/dev/null || echo "(no log yet)"
        done
        echo "---- all logs are in $LOG_DIR ----"
    } >&2
    exit 1
}

# Retry a check until it passes or `timeout` seconds are gone.
wait_until() {
    local timeout=$1; shift
    local deadline=$((SECONDS + timeout))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.2
    done
}

# The pid in the daemon's pid file, if that process is alive and is that daemon. A zombie
# counts as gone: PID 1 in a container may not reap the orphans of daemons we killed.
pid_of() {
    local pidfile pid state
    pidfile=$(pidfile_of "$1")
    pid=$(cat "$pidfile" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$(comm_of "$1")" ]] || return 1
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
    [[ $state != Z ]] || return 1
    echo "$pid"
}
running() { pid_of "$1" >/dev/null; }
stopped() { ! running "$1"; }

# ---------------------------------------------------------------------------- install

POLICY_RC=/usr/sbin/policy-rc.d
POLICY_RC_OURS=0
cleanup() { if ((POLICY_RC_OURS)); then rm -f "$POLICY_RC"; fi; }
trap cleanup EXIT

install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    say "installing ${missing[*]} (apt log: $LOG_DIR/apt.log)"
    # The packages' maintainer scripts would start munge, MariaDB and Slurm through their
    # init scripts with the packaged settings; this script starts them itself, with its own.
    if [[ ! -e $POLICY_RC ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$POLICY_RC"
        chmod 755 "$POLICY_RC"
        POLICY_RC_OURS=1
    fi
    {
        apt-get update &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
    } >>"$LOG_DIR/apt.log" 2>&1 || die "apt-get failed; see $LOG_DIR/apt.log"
    cleanup
    POLICY_RC_OURS=0
    say "packages installed"
}

# ---------------------------------------------------------------------------- configure

CONFIG_CHANGED=0

# Write stdin to a config file only if it differs, and never over a file we did not write
# (this may be a machine with a real Slurm config).
write_config() {
    local dest=$1 mode=$2 tmp
    tmp=$(mktemp)
    cat >"$tmp"
    if [[ -e $dest ]] && ! grep -qF "$MARKER" "$dest"; then
        rm -f "$tmp"
        die "$dest exists and was not written by this script; move it away first"
    fi
    if cmp -s "$tmp" "$dest"; then
        rm -f "$tmp"
        return 0
    fi
    install -m "$mode" -o root -g root "$tmp" "$dest"
    rm -f "$tmp"
    CONFIG_CHANGED=1
    say "wrote $dest"
}

make_dirs() {
    install -d -m 755 "$ETC" "$LOG_DIR" "$RUN_DIR" "$SPOOL" "$SPOOL/ctld" "$SPOOL/d" "$SPOOL/d/$NODE"
    local e
    for e in "${EMULATED[@]}"; do install -d -m 755 "$SPOOL/d/${e%%:*}"; done
    # munged and mariadbd run as their own users and write their pid files and sockets here;
    # without systemd nothing else creates these runtime directories.
    install -d -m 755 -o munge -g munge /run/munge
    install -d -m 755 -o mysql -g mysql /run/mysqld
}

munge_key() {
    local key=/etc/munge/munge.key
    if [[ ! -s $key ]]; then
        mungekey -c -k "$key"
        say "created $key"
    fi
    # munged refuses a key that is not its own and private.
    chown munge:munge "$key"
    chmod 600 "$key"
}

# Memory as the hardware reports it (via `slurmd -C`), so slurmd and slurmctld agree on it.
real_memory() {
    local mem
    mem=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
    [[ -n $mem ]] || mem=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
    echo "$mem"
}

write_configs() {
    local mem e nodes=""
    mem=$(real_memory)
    for e in "${EMULATED[@]}"; do
        nodes+="NodeName=${e%%:*} NodeHostname=$NODE NodeAddr=127.0.0.1 Port=${e##*:} CPUs=$CPUS RealMemory=$mem State=UNKNOWN"$'\n'
    done
    write_config "$ETC/slurm.conf" 644 <<EOF
$MARKER; rerun it rather than editing this file.
ClusterName=$CLUSTER
SlurmctldHost=$NODE(127.0.0.1)
# No systemd, no slurm user to set up: every Slurm daemon runs as root.
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# pmi2 works with PyPI's mpich; pmix is there too (libpmix-dev) for srun --mpi=pmix.
MpiDefault=pmi2
# No cgroups to rely on in a container: track processes by parentage, bind nothing.
# Neither plugin reads cgroup.conf, so there is none.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
# A node that comes back after slurmd restarts is usable again at once.
ReturnToService=2
SchedulerType=sched/backfill
# Start a submitted batch job at once; the default waits up to 3 s to batch submissions. Run the
# full scheduling pass every 5 s instead of 60 s, so a job whose begin time has come (a requeued one)
# starts within seconds.
SchedulerParameters=batch_sched_delay=0,sched_interval=5
SelectType=select/cons_tres
# Cores only: with memory as a resource, a job without --mem would take the whole node.
SelectTypeParameters=CR_Core
# Trust the node line below over the hardware, so the node can advertise more CPUs.
SlurmdParameters=config_overrides
# Cancelled jobs get SIGKILL 5 s after SIGTERM instead of 30 s.
KillWait=5
# Debian ships no mailer; without this slurmctld logs an error at every start.
MailProg=/bin/true
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
# Per node (%n): three slurmd run on this host.
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/d/%n
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$mem State=UNKNOWN
$nodes
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
PartitionName=$MULTI Nodes=$NODE-a,$NODE-b MaxTime=INFINITE State=UP
EOF

    if [[ ! -s $DB_PASS_FILE ]]; then
        (umask 077 && head -c 24 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' >"$DB_PASS_FILE")
    fi
    # slurmdbd refuses a config that others can read (it holds the DB password).
    write_config "$ETC/slurmdbd.conf" 600 <<EOF
$MARKER; rerun it rather than editing this file.
AuthType=auth/munge
DbdHost=$NODE
DbdAddr=127.0.0.1
SlurmUser=root
LogFile=$LOG_DIR/slurmdbd.log
PidFile=$RUN_DIR/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=$(cat "$DB_PASS_FILE")
EOF
}

# ---------------------------------------------------------------------------- start

start_munged() {
    local log
    log=$(logfile_of munged)
    # munged (running as munge) must be able to write its log.
    touch "$log" && chown munge:munge "$log"
    runuser -u munge -- munged --log-file="$log" --pid-file="$(pidfile_of munged)"
}

start_mariadb() {
    # A datadir of our own, initialised once; the marker tells a finished initialisation
    # from one that was interrupted (which is then redone from scratch).
    if [[ ! -e $DB_DIR/.slurm-dev-initialised ]]; then
        rm -rf "$DB_DIR"
        install -d -m 750 -o mysql -g mysql "$DB_DIR"
        TMPDIR=$DAEMON_TMP mariadb-install-db --no-defaults --user=mysql --datadir="$DB_DIR" --tmpdir="$DAEMON_TMP" \
            --auth-root-authentication-method=socket --skip-test-db || return 1
        touch "$DB_DIR/.slurm-dev-initialised"
    fi
    # --no-defaults: ignore /etc/mysql; --skip-networking: the socket is enough for slurmdbd,
    # and there is no port to collide with another MariaDB or MySQL on the machine. The
    # InnoDB values are the least slurmdbd accepts without logging an error (the pool is
    # reserved, not used, until the database grows).
    setsid nohup mariadbd --no-defaults --user=mysql --datadir="$DB_DIR" \
        --socket="$DB_SOCK" --pid-file="$(pidfile_of mariadb)" --skip-networking --tmpdir="$DAEMON_TMP" \
        --log-error="$(logfile_of mariadb)" \
        --innodb-buffer-pool-size=512M --innodb-lock-wait-timeout=900 </dev/null &
}

db_ready() { mariadb --socket="$DB_SOCK" -e 'SELECT 1'; }

# Idempotent: run before every slurmdbd start, so the password always matches slurmdbd.conf.
setup_database() {
    wait_until "$TIMEOUT" db_ready || die_with_logs "MariaDB does not answer on $DB_SOCK" mariadb
    mariadb --socket="$DB_SOCK" <<EOF || die_with_logs "creating the accounting database failed" mariadb
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$(cat "$DB_PASS_FILE")';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
EOF
}

start_slurmdbd() { slurmdbd; }
start_slurmctld() { slurmctld; }
start_slurmd() { slurmd; }
start_slurmd_a() { slurmd -N "$(node_of slurmd_a)"; }
start_slurmd_b() { slurmd -N "$(node_of slurmd_b)"; }

# Start a daemon unless its pid file names a live process, then wait for that pid file.
# The start_* functions write to the daemon's log and only return a status.
ensure_running() {
    local name=$1 pid
    if pid=$(pid_of "$name"); then
        say "$name already running (pid $pid)"
        return 0
    fi
    rm -f "$(pidfile_of "$name")"
    [[ $name != slurmdbd ]] || setup_database
    DAEMON_TMP=$(tmpdir_of "$name")
    # 9>&-: a daemon must not inherit (and so keep holding) our lock.
    TMPDIR=$DAEMON_TMP "start_$name" >>"$(logfile_of "$name")" 2>&1 9>&- || die_with_logs "$name failed to start" "$name"
    wait_until "$TIMEOUT" running "$name" ||
        die_with_logs "$name did not come up within ${TIMEOUT}s (no live pid in $(pidfile_of "$name"))" "$name"
    say "$name started (pid $(pid_of "$name"))"
}

munge_works() { munge -n | unmunge; }

register_cluster() {
    local clusters deadline=$((SECONDS + TIMEOUT))
    # slurmdbd writes its pid file before it answers (it first creates its tables).
    until clusters=$(timeout 10 sacctmgr -n -P list cluster format=cluster 2>/dev/null); do
        ((SECONDS < deadline)) || die_with_logs "slurmdbd does not answer sacctmgr" slurmdbd mariadb
        sleep 0.2
    done
    grep -qx "$CLUSTER" <<<"$clusters" && return 0
    timeout 30 sacctmgr -i add cluster "$CLUSTER" >/dev/null ||
        die_with_logs "sacctmgr could not add cluster $CLUSTER" slurmdbd
    say "registered cluster $CLUSTER in accounting"
}

node_state() { timeout 5 sinfo -h -n "${1:-$NODE}" -o %T 2>/dev/null; }

# Busy states count too: a warm `up` must not wait for running jobs to finish.
wait_for_node() {
    local daemon=$1 node deadline=$((SECONDS + TIMEOUT)) name
    node=$(node_of "$daemon")
    until [[ $(node_state "$node") =~ ^(idle|mixed|allocated|completing)$ ]]; do
        # A daemon that dies after writing its pid file (port taken, bad config) would
        # otherwise only show as a timeout.
        for name in slurmctld "$daemon"; do
            running "$name" || die_with_logs "$name exited while the node was coming up" "$name"
        done
        if ((SECONDS >= deadline)); then
            {
                echo "node $node state: '$(node_state "$node")'"
                timeout 5 scontrol show node "$node" 2>&1 | grep -E 'State=|Reason=' || true
            } >&2
            die_with_logs "node $node did not become idle within ${TIMEOUT}s" slurmctld "$daemon"
        fi
        sleep 0.2
    done
}

lock() {
    install -d -m 755 "$RUN_DIR"
    exec 9>"$RUN_DIR/lock"
    flock -w 300 9 || die "another dev-cluster.sh holds $RUN_DIR/lock"
}

cmd_up() {
    install -d -m 755 "$LOG_DIR"
    # Two `up`s at once would race on apt and on the pid files.
    lock
    install_packages
    make_dirs
    munge_key
    write_configs
    if ((CONFIG_CHANGED)) && { running slurmctld || running slurmd || running slurmdbd; }; then
        say "WARNING: config changed while daemons run; '$0 down && $0 up' to apply it"
    fi

    ensure_running munged
    wait_until "$TIMEOUT" munge_works || die_with_logs "munge cannot encode/decode credentials" munged
    ensure_running mariadb
    ensure_running slurmdbd
    register_cluster
    ensure_running slurmctld
    local d
    for d in slurmd slurmd_a slurmd_b; do ensure_running "$d"; done
    for d in slurmd slurmd_a slurmd_b; do wait_for_node "$d"; done
    say "nodes $NODE ($PARTITION), $NODE-a and $NODE-b ($MULTI) are up; cluster '$CLUSTER' is up (logs: $LOG_DIR)"
}

# ---------------------------------------------------------------------------- stop

stop_daemon() {
    local name=$1 pid
    if ! pid=$(pid_of "$name"); then
        rm -f "$(pidfile_of "$name")"
        say "$name not running"
        return 0
    fi
    kill -TERM "$pid"
    # MariaDB flushes InnoDB on the way down, hence the long wait before SIGKILL.
    if ! wait_until "$TIMEOUT" stopped "$name"; then
        say "WARNING: $name (pid $pid) ignored SIGTERM for ${TIMEOUT}s; sending SIGKILL (see $(logfile_of "$name"))"
        kill -KILL "$pid" 2>/dev/null || true
        wait_until 10 stopped "$name" || die "$name (pid $pid) survived SIGKILL"
    fi
    rm -f "$(pidfile_of "$name")"
    say "$name stopped (was pid $pid)"
}

cmd_down() {
    local i jobs
    lock
    if running slurmctld; then
        jobs=$(timeout 10 squeue -h -t RUNNING 2>/dev/null | wc -l) || jobs=0
        if ((jobs > 0)); then
            say "note: $jobs job(s) still running; their steps survive slurmd and are picked up again by the next 'up' (scancel them to end them)"
        fi
    fi
    for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
        stop_daemon "${DAEMONS[i]}"
    done
}

# ---------------------------------------------------------------------------- status

cmd_status() {
    local name pid all=0
    for name in "${DAEMONS[@]}"; do
        if pid=$(pid_of "$name"); then
            printf '%-10s running (pid %s)\n' "$name" "$pid"
        else
            printf '%-10s stopped\n' "$name"
            all=3
        fi
    done
    if running slurmctld; then
        timeout 10 sinfo || true
    fi
    echo "logs: $LOG_DIR"
    return "$all"
}

[[ $(id -u) == 0 ]] || die "run as root (it installs packages and starts system daemons)"
case ${1:-} in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
