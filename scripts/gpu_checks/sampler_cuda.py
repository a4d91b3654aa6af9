"""GPU check: the torch sampler on CUDA -- the engine's bf16 logits against the CPU float32
engine, generation through the continuous batcher, and a pool of SamplerActor ranks with
device "cuda" pinned one GPU per rank, its GPU names checked against a label.

Prints one JSON line per part; exits non-zero on a failure. Needs a CUDA GPU.
"""

from __future__ import annotations

import json
import sys

import torch
import trio

from actors.models import build_model, default_model_config, model_weights
from actors.sampler import ContinuousBatcher, GenerateRequest, Qwen3Engine, SamplerActor
from hardware import detected_gpu, gpu_mismatch
from orchestrator.runtime import open_mesh
from orchestrator.weightsync import wire_snapshot


def report(part: str, ok: bool, **fields: object) -> bool:
    print(json.dumps({"check": f"sampler_cuda.{part}", "status": "passed" if ok else "failed", **fields}), flush=True)
    return ok


def engine_parts() -> bool:
    cfg = default_model_config()
    snap = wire_snapshot(model_weights(build_model(cfg, seed=0)), "bf16")
    cpu, gpu = Qwen3Engine(cfg, max_slots=2), Qwen3Engine(cfg, max_slots=2, device="cuda")
    cpu.load(snap)
    gpu.load(snap)
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    a, b = cpu.prefill([0], prompt), gpu.prefill([0], prompt).float().cpu()
    err = float((a - b).abs().max() / a.abs().max())
    ok = report("logits_vs_cpu", err < 0.05, rel_max_err=err)
    b2 = ContinuousBatcher(gpu, pool="gpu")
    b2.set_weights(snap, 0)
    b2.submit(GenerateRequest(request_id="r", prompt_ids=[1, 2, 3], max_new_tokens=16, top_k=8))
    out = []
    while b2.has_work():
        out += b2.step()
    return (
        report(
            "batcher_generates", len(out) == 1 and len(out[0].token_ids) > 0, tokens=len(out[0].token_ids) if out else 0
        )
        and ok
    )


async def pool_parts() -> bool:
    n = torch.cuda.device_count()
    label = detected_gpu(torch.cuda.get_device_name(0)) or "H100-SXM"
    async with open_mesh(
        SamplerActor, "gpu-pool", "bf16", None, "cuda", init_seed=0, gpus=list(range(n)), procs=n, name="sampler-gpu"
    ) as mesh:
        names = [x for rank in await mesh.device_names.call() for x in rank]
        res = await mesh[0].generate.call_one(GenerateRequest(request_id="g", prompt_ids=[1, 2], max_new_tokens=8))
    ok = report("pool_one_gpu_per_rank", len(names) == n and len(res.token_ids) > 0, devices=names)
    return report("label_check", gpu_mismatch("gpu-pool", label, names) is None, label=label) and ok


if __name__ == "__main__":
    ok = engine_parts()
    ok = trio.run(pool_parts) and ok
    sys.exit(0 if ok else 1)
