"""A real Slurm cluster on this machine for the tests: munged, slurmctld and two slurmd (nodes n1 and n2, both on
127.0.0.1 with their own ports), from Debian's slurm-wlm and munge (`make test` installs them). Every file, socket
and port is private to one cluster, so it does not meet a Slurm the machine may already run; the commands reach it
through SLURM_CONF."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel")
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def missing() -> str | None:
    """Why a cluster cannot start here, in one line; None when it can."""
    absent = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if absent:
        return (f"Slurm is not installed ({', '.join(absent)} not found): `make slurm` (part of `make test`) installs "
                "Debian's slurm-wlm and munge as root")
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs; run the Slurm tests as root (CI does)"
    return None


def free_ports(n: int) -> list[int]:
    """n TCP ports on 127.0.0.1 that nothing listened on a moment ago (for daemons a test starts)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class Cluster:
    """Start with `start()`, stop with `stop()`; `env` is the environment that reaches it."""

    def __init__(self, cpus: int = 2, requeue_delay_s: int = 90):
        self.dir = Path(tempfile.mkdtemp(prefix="jaxlm-slurm-"))  # short: a socket path has at most 107 bytes
        self.conf = self.dir / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        ctld, d1, d2 = free_ports(3)
        sock = self.dir / "munge.sock"
        for sub in ("state", "spool", "log"):
            (self.dir / sub).mkdir()
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.munge = [_sbin("munged"), "--force", f"--socket={sock}", f"--key-file={key}",
                      f"--pid-file={self.dir / 'munged.pid'}", f"--seed-file={self.dir / 'munged.seed'}",
                      f"--log-file={self.dir / 'log' / 'munged.log'}"]
        # cred_expire: how long a requeued job waits before it may start again (Slurm's default is 120 s). Shorter
        # than about 75 s is not safe: here a step ended by `srun --kill-on-bad-exit` was signalled again 71 s
        # later, and a rerun started by then (same job and step id) was cancelled with it (seen at 5 and 30 s).
        self.conf.write_text(f"""ClusterName=jaxlmtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock},cred_expire={requeue_delay_s}
CredType=cred/munge
StateSaveLocation={self.dir / 'state'}
SlurmdSpoolDir={self.dir / 'spool'}/%n
SlurmctldPidFile={self.dir / 'slurmctld.pid'}
SlurmdPidFile={self.dir / 'slurmd-%n.pid'}
SlurmctldLogFile={self.dir / 'log' / 'slurmctld.log'}
SlurmdLogFile={self.dir / 'log' / 'slurmd-%n.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=3600
KillWait=10
NodeName=n1 NodeAddr=127.0.0.1 NodeHostname=localhost Port={d1} CPUs={cpus} State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 NodeHostname=localhost Port={d2} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
""")

    def run(self, *args: str, check: bool = True) -> str:
        p = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=60)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: {p.stderr.strip() or p.stdout.strip()}")
        return p.stdout

    def start(self, timeout_s: float = 60) -> None:
        subprocess.run(self.munge, env=self.env, check=True, capture_output=True, timeout=30)
        subprocess.run([_sbin("slurmctld"), "-f", str(self.conf)], env=self.env, check=True, timeout=30)
        for node in ("n1", "n2"):
            subprocess.run([_sbin("slurmd"), "-f", str(self.conf), "-N", node], env=self.env, check=True, timeout=30)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T %D"], env=self.env, capture_output=True, text=True).stdout
            if out.split()[:2] == ["idle", "2"]:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Slurm nodes did not come up: {out!r}; logs in {self.dir / 'log'}")

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        text = self.run("scontrol", "show", "job", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: str, timeout_s: float) -> dict:
        """Wait until the job has finished for good (a requeued job passes through pending again)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in FINISHED:
                return info
            time.sleep(1)
        raise TimeoutError(f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout_s} s")

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True, timeout=30)
        time.sleep(1)
        for name in ("slurmd-n1.pid", "slurmd-n2.pid", "slurmctld.pid", "munged.pid"):
            try:
                os.kill(int((self.dir / name).read_text()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
        time.sleep(1)
        shutil.rmtree(self.dir, ignore_errors=True)
