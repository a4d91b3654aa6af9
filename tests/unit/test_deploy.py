"""The launch recipes in deploy/: the Kubernetes manifest parses and is consistent with itself
and with Flotilla's config; the Slurm script renders (dry run) commands whose config is valid."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import yaml

from orchestrator.state.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_kubernetes_manifest_places_a_pool_on_the_statefulset() -> None:
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy/k8s/flotilla.yaml").read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert set(by_kind) == {"Secret", "ConfigMap", "Service", "StatefulSet", "Job"}
    secret, sts, job, svc = by_kind["Secret"], by_kind["StatefulSet"], by_kind["Job"], by_kind["Service"]
    assert set(secret["stringData"]) == {"id.key", "id.key_secret"}

    raw = tomllib.loads(by_kind["ConfigMap"]["data"]["run.toml"])
    cfg = load_config(raw=raw)  # a valid run config
    pool = next(p for p in cfg.pools if p.hosts)
    # every StatefulSet pod is a host of the pool, by its stable DNS name and control port
    host_cmd = _exec_argv(sts["spec"]["template"]["spec"]["containers"][0])
    port = host_cmd[host_cmd.index("--bind") + 1].rsplit(":", 1)[1]
    expected = [
        f"tcp://{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:{port}"
        for i in range(sts["spec"]["replicas"])
    ]
    assert pool.hosts == expected
    assert svc["metadata"]["name"] == sts["spec"]["serviceName"] and svc["spec"]["clusterIP"] == "None"
    assert host_cmd[:2] == ["flotilla", "host"] and host_cmd[host_cmd.index("--keys") + 1] == pool.keys
    assert "--trust-own-key" in host_cmd  # every pod presents the shared key
    # both sides copy the same Secret into the private key directory the config names
    for spec in (sts["spec"]["template"]["spec"], job["spec"]["template"]["spec"]):
        container = spec["containers"][0]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "keys")
        vol = next(v for v in spec["volumes"] if v["name"] == "keys")
        assert vol["secret"]["secretName"] == secret["metadata"]["name"]
        script = container["command"][2]
        assert f"install -d -m 700 {pool.keys}" in script
        assert f"install -m 600 {mount['mountPath']}/id.key {mount['mountPath']}/id.key_secret {pool.keys}/" in script
    ctl = job["spec"]["template"]["spec"]["containers"][0]
    cm_mount = next(m for m in ctl["volumeMounts"] if m["name"] == "config")
    assert _exec_argv(ctl) == ["flotilla", "run", f"{cm_mount['mountPath']}/run.toml"]
    assert (
        pool.count
        == sts["spec"]["replicas"]
        * sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    )


def _exec_argv(container: dict) -> list[str]:
    """The command a container's `sh -c` script finally execs."""
    cmd = container["command"]
    assert cmd[:2] == ["sh", "-c"]
    return shlex.split(cmd[2].rsplit("exec ", 1)[1])


def test_slurm_script_renders_hosts_and_a_valid_run_command(tmp_path: Path) -> None:
    script = ROOT / "deploy/slurm/flotilla.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    directives = re.findall(r"^#SBATCH (--[\w-]+)", script.read_text(), flags=re.M)
    assert {"--nodes", "--ntasks-per-node", "--gpus-per-node"} <= set(directives)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-a\\ngpu-b\\ngpu-c\\n'\n")  # Slurm's node list
    (fake / "scontrol").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{fake}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "gpu-[a-c]",
        "FLOTILLA_DRY_RUN": "1",
        "CONFIG": str(ROOT / "examples/guess_number.toml"),
        "POOL": "1",
        "KEYS": "/shared/keys",
        "PORT": "6000",
    }
    out = subprocess.run(
        ["bash", str(script), "--steps", "3"], env=env, capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.splitlines()
    host_line = next(shlex.split(line) for line in out if " host " in line)
    assert host_line[:9] == [
        "srun",
        "--overlap",
        "--job-name=flotilla-hosts",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--nodelist=gpu-b,gpu-c",
        "flotilla",
        "host",
    ]
    assert host_line[9:] == ["--bind", "tcp://0.0.0.0:6000", "--keys", "/shared/keys", "--trust-own-key"]
    run_line = next(shlex.split(line) for line in out if " run " in line)
    assert run_line[:6] == ["srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=gpu-a", "flotilla"]
    args = run_line[6:]
    assert args[-2:] == ["--steps", "3"]  # the script's own arguments go to `flotilla run`
    overrides = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    cfg = load_config(args[1], overrides)  # the rendered command's config validates
    assert cfg.pools[1].hosts == ["tcp://gpu-b:6000", "tcp://gpu-c:6000"]
    assert cfg.pools[1].keys == "/shared/keys" and not cfg.pools[0].hosts


def test_slurm_script_refuses_a_single_task_and_shares_a_node_between_two(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\necho gpu-a\n")
    (fake / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-a", "FLOTILLA_DRY_RUN": "1"}
    env.pop("SLURM_NTASKS", None)
    script = str(ROOT / "deploy/slurm/flotilla.sbatch")
    r = subprocess.run(["bash", script], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "at least 2 nodes, or 1 node and --ntasks-per-node=2" in r.stderr
    # one node, two tasks: the host runs beside the controller, both steps may share the node
    r = subprocess.run(
        ["bash", script], env={**env, "SLURM_NTASKS": "2", "PORT": "6000"}, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    lines = [shlex.split(line) for line in r.stdout.splitlines()]
    host_line = next(line for line in lines if "host" in line)
    run_line = next(line for line in lines if "run" in line)
    assert "--nodelist=gpu-a" in host_line and "--ntasks=1" in host_line and "--overlap" in host_line
    assert "--nodelist=gpu-a" in run_line and "--overlap" in run_line
    assert "pools.0.hosts=[\"tcp://gpu-a:6000\"]" in run_line
