"""A real one-node Slurm cluster in a temp dir, for running deploy/slurm/flotilla.sbatch.

`slurm_unavailable()` says why no cluster can be started here (not root, no Slurm and no
apt-get to install it), or installs Debian's `slurm-wlm` and `munge` and returns None.
`single_node_cluster(tmp)` starts a private munged, slurmctld and slurmd (generated
slurm.conf: this host as the one node, its own ports and state directories, no GPUs) and
stops all three on exit, also when the body raises; `submit_recipe` runs the Flotilla
recipe on it (one node, two tasks: the controller and one host) and waits for the job.
Nothing outside the temp dir is written; the daemons listen on free ports of this host.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "deploy/slurm/flotilla.sbatch"
DAEMONS = ("munged", "slurmctld", "slurmd")


def slurm_unavailable(install: bool = True) -> str | None:
    """None when Slurm and munge can run here (installing them with apt-get if missing and
    ``install``), else the reason they cannot."""
    if os.geteuid() != 0:
        return "a Slurm cluster needs root (slurmd runs jobs as their owner)"
    if all(shutil.which(d) or Path("/usr/sbin", d).exists() for d in DAEMONS):
        return None
    if not install or shutil.which("apt-get") is None:
        return "slurm-wlm and munge are not installed and apt-get is not available to install them"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    r = subprocess.run(
        ["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"], env=env, capture_output=True, text=True
    )
    if r.returncode != 0:
        return f"apt-get install slurm-wlm munge failed: {r.stderr.strip().splitlines()[-1:]}"
    return None


def _bin(name: str) -> str:
    found = shutil.which(name) or str(Path("/usr/sbin", name))
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    """A running one-node cluster: its config (pass ``env`` to Slurm's commands) and logs."""

    dir: Path
    node: str
    env: dict[str, str]

    def log_tail(self, chars: int = 3000) -> str:
        logs = sorted((self.dir / "log").glob("*"))
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in logs)


def _write_conf(d: Path, node: str, cpus: int) -> Path:
    conf = d / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=flotilla-test",
                f"SlurmctldHost={node}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={d}/munge/sock",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                f"StateSaveLocation={d}/state",
                f"SlurmdSpoolDir={d}/spool",
                f"SlurmctldPidFile={d}/slurmctld.pid",
                f"SlurmdPidFile={d}/slurmd.pid",
                f"SlurmctldLogFile={d}/log/slurmctld.log",
                f"SlurmdLogFile={d}/log/slurmd.log",
                # no cgroups in a container: track processes by parentage, bind nothing
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "MpiDefault=none",
                "MailProg=/bin/true",
                "ReturnToService=2",
                # the node is declared with at least 4 CPUs whatever this machine has
                "SlurmdParameters=config_overrides",
                f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4000 State=UNKNOWN",
                "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    return conf


@contextlib.contextmanager
def single_node_cluster(tmp: Path, ready_timeout: float = 60.0) -> Iterator[Cluster]:
    """munged + slurmctld + slurmd under ``tmp``; yields once the node is idle.

    Raises RuntimeError (with the daemons' logs) if the node is not idle within
    ``ready_timeout`` s. On exit every job is cancelled and the three daemons are stopped
    (SIGTERM, then SIGKILL after 10 s)."""
    d = tmp
    for sub in ("state", "spool", "log", "munge"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / "munge").chmod(0o700)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    node = socket.gethostname().split(".")[0]
    conf = _write_conf(d, node, max(4, os.cpu_count() or 1))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str) -> None:
        with (d / "log" / f"{name}.out").open("wb") as out:  # the child keeps its own copy
            procs.append(subprocess.Popen([_bin(name), *args], stdout=out, stderr=subprocess.STDOUT, env=env))

    try:
        m = d / "munge"
        start(
            "munged",
            "-F",
            "-f",
            f"--socket={m}/sock",
            f"--key-file={key}",
            f"--log-file={d}/log/munged.log",
            f"--pid-file={m}/pid",
            f"--seed-file={m}/seed",
        )
        _wait(lambda: (m / "sock").exists(), ready_timeout, "munged did not create its socket", d)
        start("slurmctld", "-D", "-f", str(conf))
        start("slurmd", "-D", "-f", str(conf))
        cluster = Cluster(dir=d, node=node, env=env)

        def idle() -> bool:
            r = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
            return r.returncode == 0 and r.stdout.strip() == "idle"

        _wait(idle, ready_timeout, "the Slurm node did not become idle", d, cluster)
        yield cluster
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True)
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _wait(ok, timeout: float, what: str, d: Path, cluster: Cluster | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            logs = cluster.log_tail() if cluster else ""
            raise RuntimeError(f"{what} within {timeout:.0f}s ({d})\n{logs}")
        time.sleep(0.5)


@dataclass
class JobResult:
    """The job's exit status (None: it never ended or was never submitted), its final Slurm
    state, its output file's text (or sbatch's error) and the run directory."""

    returncode: int | None
    state: str
    output: str
    run_dir: Path


def submit_recipe(
    cluster: Cluster, work: Path, config: Path, *run_args: str, name: str = "slurm", timeout: float = 300
) -> JobResult:
    """Submit deploy/slurm/flotilla.sbatch on one node with two tasks (controller + host),
    pool 0 on the host, and wait for the job to end. ``run_args`` go to
    `flotilla run`; the run writes under ``work/runs/<name>``."""
    work.mkdir(parents=True, exist_ok=True)
    env = {
        **cluster.env,
        "CONFIG": str(config),
        "POOL": "0",
        "KEYS": str(work / "keys"),
        "PORT": str(free_port()),
        "PYTHON": sys.executable,
        "FLOTILLA": f"{sys.executable} -m orchestrator",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "RETRY_S": "3",
    }
    out = work / "job.out"
    r = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=1",
            "--ntasks-per-node=2",
            "--gpus-per-node=0",  # the recipe asks for GPUs; this node has none
            f"--time={int(timeout // 60) + 1}",
            f"--output={out}",
            f"--chdir={work}",
            str(RECIPE),
            "--set",
            f"run_root={work / 'runs'}",
            "--set",
            f"name={name}",
            *run_args,
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        return JobResult(None, "", f"sbatch failed: {r.stdout}{r.stderr}", work / "runs" / name)
    job_id = r.stdout.strip().split(";")[0]
    state, code = _wait_job(cluster, job_id, timeout)
    text = out.read_text(errors="replace") if out.exists() else ""
    return JobResult(code, state, text, work / "runs" / name)


def _wait_job(cluster: Cluster, job_id: str, timeout: float) -> tuple[str, int | None]:
    """Poll the job (``sbatch --wait`` backs off to long sleeps) until it ends: its final
    state and exit status; ("TIMEOUT-IN-TEST", None) after ``timeout`` s, when it is
    cancelled."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=cluster.env, capture_output=True, text=True)
        fields = dict(f.split("=", 1) for f in r.stdout.split() if "=" in f)
        state = fields.get("JobState", "")
        if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return state, int(fields.get("ExitCode", "-1:0").split(":")[0])
        time.sleep(1.0)
    subprocess.run(["scancel", job_id], env=cluster.env, capture_output=True)
    return "TIMEOUT-IN-TEST", None
