"""A local Slurm cluster on this machine, for the tests and for trying `lowband launch -s slurm`
without a cluster: munge, MariaDB, slurmdbd (so `sacct`, which TorchX reads, answers), slurmctld
and N slurmd nodes, all Debian's packages, all run as root from one state directory.

    python -m lowband.testing.slurm_cluster up --nodes 2         # nodes on loopback
    python -m lowband.testing.slurm_cluster up --nodes 2 --link 100mbit  # each node a test host
    eval "$(python -m lowband.testing.slurm_cluster env)"        # SLURM_CONF: sbatch, sacct, TorchX
    python -m lowband.testing.slurm_cluster down

`up` is idempotent: a cluster already up from the same directory is left as it is. With --link,
each slurmd runs in a network namespace of its own (lowband.launch.hosts.TestHosts) whose
egress is shaped to that rate, so a job's nodes really talk over a slow link; the controller
stays in this namespace, joined to the hosts' bridge. `down` stops only what `up` started (the pids it
recorded, the lines it added to /etc/hosts, the test hosts) and keeps the state directory's logs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_ROOT = Path("/var/tmp/lowband-slurm")
PACKAGES = ("munge", "mariadb-server", "slurmctld", "slurmd", "slurmdbd", "slurm-client")
CLUSTER = "lowband"
PORTS = {"mysql": 16806, "slurmctld": 16817, "slurmdbd": 16819, "slurmd": 17001}
HOSTS_MARK = "# lowband-slurm"
HOST_PREFIX, SUBNET = "lbs", "10.213.14"


class ClusterError(RuntimeError):
    pass


def missing_tools() -> list[str]:
    return [t for t in ("munged", "mariadbd", "mariadb-install-db", "slurmctld", "slurmd",
                        "slurmdbd", "sbatch", "sacct") if shutil.which(t) is None]


class LocalSlurm:
    """The cluster in `root`: nodes <prefix>-n0 .. -n{N-1} with `cpus` CPUs and `mem_mb` MB each
    in partition `debug`; with `link` (a tc rate, e.g. "100mbit") each node is a test host."""

    def __init__(self, root: str | os.PathLike = DEFAULT_ROOT, nodes: int = 2, cpus: int = 2,
                 mem_mb: int = 8000, link: str | None = None, slurmd_timeout: int = 30):
        self.root = Path(root).resolve()
        self.n, self.cpus, self.mem_mb, self.link = nodes, cpus, mem_mb, link
        # seconds without an answer before slurmctld declares a node down (and fails its jobs)
        self.slurmd_timeout = slurmd_timeout
        self.names = [f"{HOST_PREFIX}-n{i}" for i in range(nodes)]
        self.conf = self.root / "etc" / "slurm.conf"
        self.state_file = self.root / "started.json"

    # -- what the cluster is ---------------------------------------------------------------------

    def env(self) -> dict:
        """What a client (sbatch, sacct, TorchX's slurm scheduler) needs in its environment."""
        return {"SLURM_CONF": str(self.conf)}

    def hosts(self):
        from lowband.launch.hosts import TestHosts

        return TestHosts(HOST_PREFIX, SUBNET, self.link or "100mbit", "128kb", "100ms",
                         host="n", hostnames=True, n=self.n, uplink=f"{SUBNET}.254")

    def _addrs(self) -> list[str]:
        return self.hosts().addrs if self.link else ["127.0.0.1"] * self.n

    def _write_configs(self) -> None:
        r = self.root
        for d in ("etc", "log", "state", "spool", "munge", "mysql-run"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o755)  # clients need to reach the socket; the key stays 0600
        ctl_addr = f"{SUBNET}.254" if self.link else "127.0.0.1"
        auth = f"socket={r / 'munge' / 'munge.socket'}"
        nodes = "".join(
            f"NodeName={name} NodeAddr={addr} Port={PORTS['slurmd'] + i} CPUs={self.cpus} "
            f"RealMemory={self.mem_mb} State=UNKNOWN\n"
            for i, (name, addr) in enumerate(zip(self.names, self._addrs())))
        self.conf.write_text(f"""# written by lowband.testing.slurm_cluster
ClusterName={CLUSTER}
SlurmctldHost={socket.gethostname()}({ctl_addr})
SlurmctldPort={PORTS['slurmctld']}
AuthType=auth/munge
AuthInfo={auth}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}/%n
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd-%n.pid'}
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log'}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SchedulerType=sched/backfill
# heterogeneous jobs (TorchX's) are scheduled by the backfill pass only: run it every second
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort={PORTS['slurmdbd']}
AccountingStoragePass={r / 'munge' / 'munge.socket'}
JobCompType=jobcomp/none
MailProg=/bin/true
JobRequeue=1
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout={self.slurmd_timeout}
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        dbd = r / "etc" / "slurmdbd.conf"  # slurmdbd reads it beside slurm.conf; it must be 0600
        dbd.write_text(f"""AuthType=auth/munge
AuthInfo={auth}
DbdHost=localhost
DbdPort={PORTS['slurmdbd']}
SlurmUser=root
PidFile={r / 'slurmdbd.pid'}
LogFile={r / 'log' / 'slurmdbd.log'}
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={PORTS['mysql']}
StorageUser=root
StorageLoc=slurm_acct_db
""")
        os.chmod(dbd, 0o600)

    # -- life cycle ------------------------------------------------------------------------------

    def _started(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}

    def _record(self, **kw) -> None:
        state = {**self._started(), **kw}
        self.state_file.write_text(json.dumps(state, indent=1))

    def is_up(self) -> bool:
        """Whether this cluster (the same nodes and link) runs and every node is up."""
        started = self._started()
        if started.get("nodes") != self.names or started.get("link") != self.link or \
                started.get("slurmd_timeout", 30) != self.slurmd_timeout or \
                not self.conf.exists() or not _alive(started.get("pids", {})):
            return False
        out = self._client("sinfo", "-h", "-o", "%T", check=False)
        states = out.stdout.split()
        return out.returncode == 0 and len(states) > 0 and all(
            s.rstrip("*~#") in ("idle", "mixed", "allocated", "completing") for s in states)

    def up(self, timeout: float = 90.0) -> "LocalSlurm":
        """Start whatever is not running yet and wait until every node is idle."""
        if missing_tools():
            raise ClusterError(f"Slurm's Debian packages are missing ({', '.join(missing_tools())}"
                               f" not found): apt-get install {' '.join(PACKAGES)}.")
        if os.geteuid() != 0:
            raise ClusterError("the local Slurm cluster runs its daemons as root: run as root.")
        if self.is_up():
            return self
        self.down()  # a half-started or crashed cluster of ours
        self._write_configs()
        pids: dict[str, int] = {}
        self._record(pids=pids, nodes=self.names, link=self.link,
                     slurmd_timeout=self.slurmd_timeout)
        env = {**os.environ, **self.env()}
        r = self.root
        key = r / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(128))
            os.chmod(key, 0o600)
        pids["munged"] = self._daemon(
            ["munged", "--foreground", "--force", f"--socket={r / 'munge' / 'munge.socket'}",
             f"--key-file={key}", f"--pid-file={r / 'munge' / 'munged.pid'}",
             f"--log-file={r / 'log' / 'munged.log'}", f"--seed-file={r / 'munge' / 'seed'}"],
            "munged", env)
        self._record(pids=pids)
        pids["mariadbd"] = self._mariadb(env)
        self._record(pids=pids)
        _wait_port("127.0.0.1", PORTS["mysql"], 60, "MariaDB", r / "log" / "mariadb.log",
                   pids["mariadbd"])
        pids["slurmdbd"] = self._daemon(["slurmdbd", "-D"], "slurmdbd", env)
        self._record(pids=pids)
        _wait_port("127.0.0.1", PORTS["slurmdbd"], 60, "slurmdbd", r / "log" / "slurmdbd.log",
                   pids["slurmdbd"])
        pids["slurmctld"] = self._daemon(["slurmctld", "-D", "-i"], "slurmctld", env)
        self._record(pids=pids)
        _wait_port("127.0.0.1", PORTS["slurmctld"], 60, "slurmctld", r / "log" / "slurmctld.log",
                   pids["slurmctld"])
        if self.link:
            self.hosts().setup()
        else:
            self._add_etc_hosts()
        for name in self.names:
            (r / "spool" / name).mkdir(parents=True, exist_ok=True)
            pids[name] = self._slurmd(name, env)
        self._record(pids=pids)
        deadline = time.monotonic() + timeout
        while not self.is_up():
            if time.monotonic() > deadline:
                info = self._client("sinfo", "-N", "-l", check=False).stdout.strip()
                raise ClusterError(f"the Slurm nodes did not come up within {timeout:g} s "
                                   f"(sinfo: {info or 'no answer'}); see the logs in {r / 'log'}.")
            time.sleep(0.5)
        # jobs of an earlier life of this cluster, kept in its saved state (their processes
        # were stopped with it): they would hold nodes, and names, of their own
        stale = self._client("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if stale:
            self._client("scancel", *stale, check=False)
            while self._client("squeue", "-h", "-o", "%i", check=False).stdout.split() or \
                    not self.is_up():
                if time.monotonic() > deadline + 60:
                    raise ClusterError(f"jobs of an earlier run of this cluster ("
                                       f"{', '.join(stale)}) did not end when cancelled; see "
                                       f"the logs in {r / 'log'}.")
                time.sleep(0.5)
        return self

    def lose_node(self, name: str) -> list[str]:
        """Node `name` lost for good, as a machine that dies: its slurmd and every process of
        the job steps on it (their slurmstepd and all below) SIGKILLed at once, so nothing
        answers for it. Slurm notices after SlurmdTimeout. The job ids it ran."""
        jobs = self._client("squeue", "-h", "-w", name, "-o", "%A").stdout.split()
        self._kill_steps(lambda job: job in jobs, [self._started()["pids"][name]])
        return jobs

    def _kill_steps(self, chosen, more: list[int] = ()) -> None:
        """SIGKILL this cluster's slurmstepd processes whose job id is chosen(id), the pids in
        `more`, and every process below them (a slurmstepd is a session of its own, which
        stopping its slurmd leaves running)."""
        tree: dict[int, list[int]] = {}
        roots = list(more)
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                tree.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(pid))
                if cmd.startswith("slurmstepd: [") and chosen(cmd[13:].split(".")[0]) and \
                        f"SLURM_CONF={self.conf}\0".encode() in \
                        Path(f"/proc/{pid}/environ").read_bytes():
                    roots.append(int(pid))
            except OSError:
                continue
        doomed, todo = [], roots
        while todo:
            pid = todo.pop()
            doomed.append(pid)
            todo += tree.get(pid, [])
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def revive_node(self, name: str) -> None:
        """Start node `name`'s slurmd again (after lose_node): Slurm returns it to service."""
        pids = self._started()["pids"]
        pids[name] = self._slurmd(name, {**os.environ, **self.env()})
        self._record(pids=pids)

    def _slurmd(self, name: str, env: dict) -> int:
        """Node `name`'s slurmd (on its test host, with --link): its pid."""
        if self.link:
            return self.hosts().popen(self.names.index(name), [
                "sh", "-c", _CGROUPS + 'exec slurmd -D -N "$0"', name], env,
                self.root / "log" / f"{name}.out").pid
        return self._daemon(["slurmd", "-D", "-N", name], name, env)

    def _daemon(self, cmd: list[str], name: str, env: dict) -> int:
        with open(self.root / "log" / f"{name}.out", "ab") as out:
            p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        time.sleep(0.2)
        if p.poll() is not None:
            raise ClusterError(f"{name} exited at once (status {p.returncode}); see "
                               f"{self.root / 'log' / (name + '.out')}.")
        return p.pid

    def _mariadb(self, env: dict) -> int:
        data = self.root / "mysql"
        if not (data / "mysql").is_dir():
            out = subprocess.run(["mariadb-install-db", "--user=root", f"--datadir={data}",
                                  "--auth-root-authentication-method=normal", "--skip-test-db"],
                                 capture_output=True, text=True, env=env)
            if out.returncode != 0:
                raise ClusterError(f"mariadb-install-db failed: {out.stderr.strip()[-300:]}")
        # grants skipped: the accounting database listens on loopback only, for slurmdbd
        return self._daemon(["mariadbd", "--no-defaults", "--user=root", f"--datadir={data}",
                             f"--socket={self.root / 'mysql-run' / 'mysqld.sock'}",
                             f"--pid-file={self.root / 'mysql-run' / 'mysqld.pid'}",
                             f"--port={PORTS['mysql']}", "--bind-address=127.0.0.1",
                             "--skip-grant-tables", "--skip-name-resolve",
                             f"--log-error={self.root / 'log' / 'mariadb.log'}"], "mariadbd", env)

    def _add_etc_hosts(self) -> None:
        """Loopback nodes: their names resolve (a job's rendezvous names its first node)."""
        text = Path("/etc/hosts").read_text()
        add = [f"127.0.0.1 {name} {HOSTS_MARK}\n" for name in self.names
               if not _resolves(name)]
        if add:
            Path("/etc/hosts").write_text(text + ("" if text.endswith("\n") else "\n")
                                          + "".join(add))

    def down(self) -> None:
        """Stop what `up` started (and only that), remove its /etc/hosts lines and test hosts."""
        started = self._started()
        pids = started.get("pids", {})
        for name in [n for n in pids if n.startswith(HOST_PREFIX)] + \
                ["slurmctld", "slurmdbd", "mariadbd", "munged"]:
            if name in pids:
                _stop(pids[name])
        if pids:  # the job steps the nodes' slurmd left running
            self._kill_steps(lambda job: True)
        if started.get("link"):
            self.hosts().teardown()
        try:
            lines = Path("/etc/hosts").read_text().splitlines(keepends=True)
            kept = [line for line in lines if not line.rstrip().endswith(HOSTS_MARK)]
            if kept != lines:
                Path("/etc/hosts").write_text("".join(kept))
        except OSError:
            pass
        if self.state_file.exists():
            self.state_file.unlink()

    def _client(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                             env={**os.environ, **self.env()})
        if check and out.returncode != 0:
            raise ClusterError(f"`{' '.join(cmd)}` failed: {out.stderr.strip()}")
        return out


# `ip netns exec` mounts a fresh /sys, without /sys/fs/cgroup, where slurmd looks for cgroups even
# when it tracks processes without them: a cgroup v1 layout, in the host's own mount namespace
_CGROUPS = ("mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup && for c in cpu cpuacct cpuset "
            "memory devices freezer; do mkdir -p /sys/fs/cgroup/$c && mount -t cgroup -o $c "
            "cgroup /sys/fs/cgroup/$c; done; mkdir -p /sys/fs/cgroup/systemd && mount -t cgroup "
            "-o none,name=systemd cgroup /sys/fs/cgroup/systemd; ")


def _resolves(name: str) -> bool:
    try:
        socket.gethostbyname(name)
        return True
    except OSError:
        return False


def _alive(pids: dict) -> bool:
    if not pids:
        return False
    for pid in pids.values():
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
    return True


def _stop(pid: int, grace: float = 10.0) -> None:
    """SIGTERM the daemon's session (a slurmd's job steps too), SIGKILL what outlives `grace`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
                if Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z"):
                    return
            except (ProcessLookupError, OSError):
                return
            time.sleep(0.1)


def _wait_port(host: str, port: int, timeout: float, what: str, log: Path, pid: int) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive({what: pid}):
            raise ClusterError(f"{what} stopped while starting; see {log}.")
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise ClusterError(f"{what} did not listen on {host}:{port} within {timeout:g} s; see {log}.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lowband.testing.slurm_cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("command", choices=("up", "down", "env", "status"))
    p.add_argument("--root", default=str(DEFAULT_ROOT), help="state directory")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--cpus", type=int, default=2, help="CPUs each node declares")
    p.add_argument("--mem-mb", type=int, default=8000, help="memory each node declares")
    p.add_argument("--link", default=None,
                   help="each node a test host whose egress is shaped to this rate (100mbit)")
    a = p.parse_args(argv)
    cluster = LocalSlurm(a.root, a.nodes, a.cpus, a.mem_mb, a.link)
    try:
        if a.command == "up":
            cluster.up()
            print(f"Slurm cluster '{CLUSTER}' up: {a.nodes} nodes ({', '.join(cluster.names)})"
                  f"{' joined by ' + a.link + ' links' if a.link else ' on loopback'}; "
                  f"export SLURM_CONF={cluster.conf}", file=sys.stderr)
        elif a.command == "down":
            cluster.down()
        elif a.command == "env":
            print(f"export SLURM_CONF={cluster.conf}")
        else:
            print("up" if cluster.is_up() else "down")
            return 0 if cluster.is_up() else 1
    except ClusterError as e:
        print(f"lowband: error: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
