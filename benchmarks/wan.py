"""Benchmark: a sampler pool in another network, behind a 1 Gbit/s and a 100 Mbit/s link.

What: two `flotilla host` processes, each in its own network namespace behind a veth link
shaped with tc tbf (tests/netrig.py): one at 1000 Mbit/s, one at 100 Mbit/s.

1. The demo (examples/guess_number.toml) in rounds of three runs, one after the other in
   this invocation: both pools local (the baseline), then its bf16 pool placed on the
   1 Gbit/s host, then on the 100 Mbit/s host; figures are means over the rounds. Per run, from step `warm` on: steps/s (metrics
   `wall_s`), the link's bytes per step (the veth's tx+rx counters, read whenever a step's
   metrics line appears), the remote pool's rollouts and their mean staleness, and the
   delta compression ratio the controller's `weights.apply` spans show (dense bf16 bytes of
   the deltas sent ÷ their wire bytes). Async efficiency = remote steps/s ÷ local steps/s.
2. Weight sync of a larger model (Qwen3-style, ~125 M parameters, random init from a
   config): the benchmark process takes real AdamW steps at lr 1e-6 (language-model loss on
   random tokens) and publishes each through a real `WeightPublisher`; a real
   `SamplerActor` with the same model on each host receives the keyframe (in parts, as the
   controller streams it) and then every delta. Per link: seconds from the call to the
   sampler's acknowledgement (keyframe, and delta p50), bytes on the wire per delta
   (counters) ÷ the dense bf16 weights, and the raw ÷ wire ratio of the deltas. Training a
   125 M model in the full RL loop is beyond a shared 2-core machine; the deltas are real.
3. A partition (tests/integration/netruns.py's run with the demo's batch, 16 prompts x 8
   replies, and its default trace sampling: a local pool and a remote one): the remote
   host's link is cut for 30 s after 5 steps, then restored:
   `partition_prompts_lost`, `partition_train_stall_s` (the longest gap between train
   steps during the cut) against `normal_step_s` (median step over as long before the
   cut, every link up), `uncut_train_stall_s` (the longest gap over that window: the same
   statistic without a cut) and `cut_step_s` (median step during the cut, the local pool
   alone filling each batch),
   `rejoin_s` (link restored -> end of the first step with a rollout from the host).
4. An elastic pool in the same test run: no host at start, one started and listed in the
   pool's hosts file after 3 steps: `elastic_join_s` (host started -> end of the first step
   with a rollout from it).
5. The Slurm recipe (deploy/slurm/flotilla.sbatch) on a real one-node cluster
   (tests/slurmrig.py): `slurm_job_ok`.

Why: the claim that samplers can leave the training cluster rests on what a step costs on a
real link; this measures it rather than loopback.

Targets: remote_100mbit_async_efficiency >= 0.9, remote_100mbit_update_s_p50 <= 1.0
(~125 M params, lr 1e-6), wire_bytes_per_step_vs_dense <= 0.05 (the large model's deltas
over 100 Mbit/s), partition_prompts_lost = 0, partition_train_stall_s <= 2 x
normal_step_s, rejoin_s <= 10, elastic_join_s <= 10, slurm_job_ok.

How: as root, `PYTHONPATH=$PWD python benchmarks/wan.py` (two rounds of the three demo runs,
30 steps each, figures from step 5; 6 deltas per link) or `--quick` (one round of 6 steps,
from step 2; 2 deltas; a 15 s cut). `--parts demo,sync,partition,elastic,slurm` runs a
subset. Prints progress on stderr, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/weightsync.py

from _runs import demo_raw, load_average

from tests.netrig import Host, NetRig, netrig_unavailable, sweep_stale  # the repository root on PYTHONPATH

LINKS = {"1gbit": ("g", 1000), "100mbit": ("m", 100)}  # link: (rig host name, Mbit/s)
REMOTE = 0  # the demo's pool placed on a host: b200-bf16 (bf16 wire)
LARGE = {
    "model_type": "qwen3",
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "tie_word_embeddings": False,
    "max_position_embeddings": 512,
}


def log(msg: str) -> None:
    print(f"wan: {msg} (load {load_average()})", file=sys.stderr, flush=True)


def _wire(host: Host | None) -> int:
    if host is None:
        return 0
    c = host.counters()
    return c["tx_bytes"] + c["rx_bytes"]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line still being written, or cut short
            continue
    return out


def demo_run(raw: dict[str, Any], host: Host | None, keys: Path, warm: int) -> dict[str, Any]:
    """One demo run, its pool REMOTE on ``host`` (None: all local); figures from step ``warm``."""

    from orchestrator.entry.runner import run_async
    from orchestrator.state.config import load_config
    from orchestrator.state.progress import Progress

    tmp = Path(tempfile.mkdtemp(prefix="flotilla-wan-"))
    raw = json.loads(json.dumps(raw))
    raw["run_root"] = str(tmp)
    pool = raw["pools"][REMOTE]
    if host is not None:
        pool["hosts"] = [host.address]
        pool["keys"] = str(keys)
    cfg = load_config(raw=raw)
    metrics_path = cfg.run_dir / "metrics.jsonl"
    wire_at: dict[int, int] = {}  # step -> link bytes when its metrics line was seen

    async def main() -> None:
        async with trio.open_nursery() as nursery:

            async def probe() -> None:
                while True:
                    now = _wire(host)
                    for m in _read_jsonl(metrics_path):
                        wire_at.setdefault(m["step"], now)
                    await trio.sleep(0.1)

            nursery.start_soon(probe)
            await run_async(cfg, progress=Progress(cfg.steps, quiet=True))
            nursery.cancel_scope.cancel()

    wire0 = _wire(host)
    t0 = time.monotonic()
    try:
        trio.run(main)
        total_s = time.monotonic() - t0
        metrics = _read_jsonl(metrics_path)
        spans = _read_jsonl(cfg.run_dir / "traces.jsonl")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    by_step = {m["step"]: m for m in metrics}
    last = max(by_step)
    if last <= warm:
        raise RuntimeError(f"the run stopped at step {last}, before step {warm}")
    steps_per_s = (last - warm) / (by_step[last]["wall_s"] - by_step[warm]["wall_s"])
    name = pool["name"]
    rollouts = [m["pools"][name]["rollouts"] for m in metrics if m["step"] > warm]
    stale = [
        (m["pools"][name]["staleness_mean"], m["pools"][name]["rollouts"])
        for m in metrics
        if m["step"] > warm and m["pools"][name]["rollouts"]
    ]
    applies = [
        s["attributes"] | {"s": (s["end_ns"] - s["start_ns"]) / 1e9}
        for s in spans
        if s["name"] == "weights.apply" and s.get("service") == "controller" and s["attributes"].get("pool") == name
    ]
    deltas = [
        a
        for a in applies
        if not a.get("keyframe") and (a.get("from_version") or -1) >= 0 and a.get("messages") and a.get("wire_bytes")
    ]
    out: dict[str, Any] = {
        "steps": last,
        "total_s": total_s,
        "steps_per_s": steps_per_s,
        "remote_rollouts_per_step": sum(rollouts) / len(rollouts),
        "remote_staleness_mean": sum(s * n for s, n in stale) / sum(n for _, n in stale) if stale else None,
        "delta_messages": sum(a["messages"] for a in deltas),
        "delta_wire_bytes": sum(a["wire_bytes"] for a in deltas),
        "update_s_p50": statistics.median(a["s"] for a in deltas) if deltas else None,
        "wire_total": _wire(host) - wire0,
    }
    if host is not None and warm in wire_at and last in wire_at:
        out["wire_bytes_per_step"] = (wire_at[last] - wire_at[warm]) / (last - warm)
    return out


async def _weight_sync(hosts: dict[str, Host], keys: Path, deltas: int) -> dict[str, Any]:
    """Part 2 (see the module docstring): one publisher, one sampler per link."""
    import torch

    from actors.models import build_model
    from actors.sampler import SamplerActor
    from hardware import PoolConfig
    from orchestrator.controller.hosts import host_specs
    from orchestrator.runtime import open_mesh
    from orchestrator.weightsync import WeightPublisher, message_parts, snapshot_bytes

    torch.set_num_threads(2)
    model = build_model(LARGE, seed=0).train()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    gen = torch.Generator().manual_seed(1)
    pub = WeightPublisher(keyframe_interval=10_000, precisions=("bf16",), threads=2)

    def master() -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in model.named_parameters()}

    pub.publish(0, master())
    dense = snapshot_bytes(pub.snapshot("bf16"))
    keyframe = pub.keyframe("bf16")
    out: dict[str, Any] = {"large_params": params, "large_dense_bf16_bytes": dense}
    log(f"large model {params / 1e6:.1f} M params, keyframe {keyframe.nbytes / 1e6:.1f} MB")
    rows: dict[str, list[dict[str, float]]] = {link: [] for link in hosts}
    meshes = {}
    for link, host in hosts.items():
        pool = PoolConfig(name=f"wan-{link}", gpu="H100-SXM", device="cpu", hosts=[host.address], keys=str(keys))
        specs, curve, _ = host_specs(pool)
        meshes[link] = open_mesh(
            SamplerActor,
            pool.name,
            "bf16",
            LARGE,
            "cpu",
            init_seed=None,
            max_batch=1,
            max_len=64,
            procs=1,
            name=f"sampler-{pool.name}",
            hosts=specs,
            curve=curve,
        )
    async with meshes["1gbit"] as m1, meshes["100mbit"] as m2:
        samplers = {"1gbit": m1, "100mbit": m2}
        for link, mesh in samplers.items():
            await mesh[0].version.call_one()  # the sampler is up (its model built)
            w0, t0 = _wire(hosts[link]), time.perf_counter()
            for header, frames in message_parts(keyframe):
                now = await mesh[0].apply_weights_part.call_one(header, list(frames))
            out[f"remote_{link}_keyframe_s"] = time.perf_counter() - t0
            out[f"remote_{link}_keyframe_wire_bytes"] = _wire(hosts[link]) - w0
            pub.register(link, "bf16", now)
            log(f"{link}: keyframe in {out[f'remote_{link}_keyframe_s']:.1f} s")
        for version in range(1, deltas + 1):
            tokens = torch.randint(0, LARGE["vocab_size"], (1, 64), generator=gen)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            pub.publish(version, master())
            publish_s = time.perf_counter() - t0
            for link, mesh in samplers.items():
                msgs = pub.updates_for(link, version - 1, "bf16")
                frames = [m.to_frames() for m in msgs]
                w0, t0 = _wire(hosts[link]), time.perf_counter()
                now = await mesh[0].apply_weights.call_one(frames)
                took = time.perf_counter() - t0
                if now != version:
                    raise RuntimeError(f"{link}: the sampler holds v{now} after delta v{version}")
                pub.ack(link, version)
                rows[link].append(
                    {
                        "s": took,
                        "wire": _wire(hosts[link]) - w0,
                        "payload": sum(m.nbytes for m in msgs),
                        "publish_s": publish_s,
                    }
                )
            log(f"delta v{version}: " + ", ".join(f"{k} {r[-1]['s']:.2f} s" for k, r in rows.items()))
    for link, rs in rows.items():
        out[f"remote_{link}_update_s_p50"] = statistics.median(r["s"] for r in rs)
        out[f"remote_{link}_update_s_max"] = max(r["s"] for r in rs)
        out[f"remote_{link}_wire_bytes_per_delta"] = statistics.mean(r["wire"] for r in rs)
        # the link alone: the delta's bytes at the link's rate (the rest is the two ends)
        out[f"remote_{link}_update_wire_floor_s"] = (
            8 * out[f"remote_{link}_wire_bytes_per_delta"] / (LINKS[link][1] * 1e6)
        )
    out["large_publish_s_p50"] = statistics.median(r["publish_s"] for r in rows["1gbit"])
    out["delta_compression_ratio"] = dense * len(rows["100mbit"]) / sum(r["payload"] for r in rows["100mbit"])
    out["wire_bytes_per_step_vs_dense"] = out["remote_100mbit_wire_bytes_per_delta"] / dense
    return out


def partition_check(work: Path, rig: NetRig, cut_s: float) -> dict[str, Any]:
    """The demo-sized run (tests/integration/netruns.py, `demo=True`: a local pool and a
    remote one) with the remote host's link cut for ``cut_s`` s after 5 steps: prompts lost,
    the longest gap between train steps during the cut against the normal step time, and
    link restored -> first step with a rollout from the host."""
    from tests.integration.netruns import measure_partition

    m = measure_partition(work, rig, cut_s=cut_s, demo=True)
    keys = (
        "partition_prompts_lost",
        "partition_train_stall_s",
        "normal_step_s",
        "uncut_train_stall_s",
        "cut_step_s",
        "rejoin_s",
        "steps_during_cut",
    )
    ratio = m["partition_train_stall_s"] / m["normal_step_s"] if m["normal_step_s"] else None
    return {k: m[k] for k in keys} | {"partition_cut_s": cut_s, "partition_stall_vs_step": ratio}


def elastic_check(work: Path, rig: NetRig) -> dict[str, Any]:
    """An elastic remote pool (no hosts at start, a hosts file) in the test run: after 3
    steps on the local pool a host is started and listed; `elastic_join_s` is host started ->
    end of the first train step with a rollout from it."""
    from tests.integration.netruns import Run, remote_run_config, step_times

    hosts_file = work / "hosts.txt"
    hosts_file.write_text("# hosts that may join\n")
    remote = {"hosts": [], "keys": str(rig.keys), "elastic": True, "max_hosts": 1, "hosts_file": str(hosts_file)}
    run = Run(remote_run_config(work, "elastic", remote), work / "runs" / "elastic")
    joiner = rig.add_host("j", start=False)
    try:
        run.wait(lambda r: len(r) >= 3, 300, "3 steps on the local pool")
        t_start = time.time()
        joiner.start()
        hosts_file.write_text(f"{joiner.address}\n")
        n = len(run.metrics())
        run.wait(lambda r: any(x["pools"]["remote"]["rollouts"] > 0 for x in r[n:]), 120, "a rollout from the host")
    finally:
        run.stop()
    rows = run.metrics()
    first = next(r for r in rows[n:] if r["pools"]["remote"]["rollouts"] > 0)
    return {
        "elastic_join_s": step_times(run)[first["version"]] - t_start,
        "elastic_prompts_lost": rows[-1]["prompts_skipped"],
    }


def slurm_check(work: Path) -> tuple[bool, str]:
    from tests.integration.conftest import small_run_raw
    from tests.slurmrig import single_node_cluster, slurm_unavailable, submit_recipe

    reason = slurm_unavailable()
    if reason:
        return False, reason
    raw = small_run_raw(work, steps=3)
    raw["pools"] = raw["pools"][:1]
    config = work / "slurm-run.json"
    config.write_text(json.dumps(raw))
    with single_node_cluster(work / "slurm") as cluster:
        job = submit_recipe(cluster, work / "job", config)
    metrics = _read_jsonl(job.run_dir / "metrics.jsonl")
    ok = (
        (job.state, job.returncode) == ("COMPLETED", 0)
        and [m["step"] for m in metrics] == [1, 2, 3]
        and all(m["pools"][raw["pools"][0]["name"]]["rollouts"] > 0 for m in metrics)
        and (job.run_dir / "report.html").exists()
    )
    return ok, f"job {job.state} exit {job.returncode}"


def demo_part(rig: NetRig, hosts: dict[str, Host], steps: int, warm: int, rounds: int) -> dict[str, Any]:
    """Part 1 (see the module docstring)."""
    raw = demo_raw()
    raw["steps"] = steps
    raw["name"] = "wan"
    result: dict[str, Any] = {}
    # Rounds of (local, 1 Gbit/s, 100 Mbit/s) runs, so load that drifts over the
    # invocation falls on every variant alike.
    runs: dict[str, list[dict[str, Any]]] = {"local": [], **{link: [] for link in LINKS}}
    for i in range(rounds):
        for variant in runs:
            r = demo_run(raw, hosts.get(variant), rig.keys, warm)
            runs[variant].append(r)
            log(
                f"round {i + 1}, {variant}: {r['steps_per_s']:.3f} steps/s, "
                f"{r.get('wire_bytes_per_step', 0):.0f} B/step, run {r['total_s']:.0f} s"
            )
    from actors.models import build_model, default_model_config

    demo_dense = 2 * sum(p.numel() for p in build_model(default_model_config()).parameters())

    def mean(variant: str, key: str) -> float | None:
        vals = [r[key] for r in runs[variant] if r.get(key) is not None]
        return statistics.mean(vals) if vals else None

    local = mean("local", "steps_per_s")
    result["demo_local_steps_per_s"] = local
    result["demo_local_pool_staleness_mean"] = mean("local", "remote_staleness_mean")
    for link in LINKS:
        sps = mean(link, "steps_per_s")
        per_step = mean(link, "wire_bytes_per_step")
        result[f"remote_{link}_async_efficiency"] = sps / local if sps and local else None
        result[f"demo_remote_{link}_steps_per_s"] = sps
        result[f"demo_remote_{link}_wire_bytes_per_step"] = per_step
        result[f"demo_remote_{link}_wire_vs_dense"] = per_step / demo_dense if per_step else None
        result[f"demo_remote_{link}_staleness_mean"] = mean(link, "remote_staleness_mean")
        result[f"demo_remote_{link}_rollouts_per_step"] = mean(link, "remote_rollouts_per_step")
        result[f"demo_remote_{link}_update_s_p50"] = mean(link, "update_s_p50")
        wire = sum(r["delta_wire_bytes"] for r in runs[link])
        if wire:
            result[f"demo_remote_{link}_delta_compression_ratio"] = (
                demo_dense * sum(r["delta_messages"] for r in runs[link]) / wire
            )
    result["demo_dense_bf16_bytes"] = demo_dense
    return result


PARTS = ("demo", "sync", "partition", "elastic", "slurm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6-step demo runs, 2 deltas per link, a 15 s cut")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    args = ap.parse_args()
    parts = args.parts.split(",")
    if not parts or set(parts) - set(PARTS):
        sys.exit(f"wan: --parts takes a comma-separated subset of {','.join(PARTS)}, got {args.parts!r}")
    reason = netrig_unavailable()
    if reason:
        sys.exit(f"wan: {reason}")
    steps, warm, deltas, rounds, cut_s = (6, 2, 2, 1, 15.0) if args.quick else (30, 5, 6, 2, 30.0)
    result: dict[str, Any] = {
        "benchmark": "wan",
        "quick": args.quick,
        "parts": parts,
        "demo_steps": steps,
        "warm_step": warm,
        "demo_rounds": rounds,
        "deltas_per_link": deltas,
    }
    t_start = time.monotonic()
    sweep_stale()
    with NetRig() as rig, tempfile.TemporaryDirectory(prefix="flotilla-wan-") as tmp:
        work = Path(tmp)
        hosts = {link: rig.add_host(name, rate_mbit=mbit) for link, (name, mbit) in LINKS.items()}
        log(f"hosts {', '.join(f'{k} {h.address}' for k, h in hosts.items())}")
        if "demo" in parts:
            result.update(demo_part(rig, hosts, steps, warm, rounds))
        if "sync" in parts:
            result.update(trio.run(_weight_sync, hosts, rig.keys, deltas))
        for h in hosts.values():  # the links' hosts are not needed past here
            h.terminate()
        for part, check in (
            ("partition", lambda w: partition_check(w, rig, cut_s)),
            ("elastic", lambda w: elastic_check(w, rig)),
        ):
            if part in parts:
                (work / part).mkdir()
                result.update(check(work / part))
                log(f"{part}: done")
        if "slurm" in parts:
            (work / "slurm").mkdir()
            ok, why = slurm_check(work / "slurm")
            result["slurm_job_ok"] = ok
            log(f"slurm: {why}")
    result["wall_s"] = time.monotonic() - t_start
    result["load_average"] = load_average()
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
