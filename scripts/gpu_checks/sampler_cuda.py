"""GPU check: the torch sampler engine on CUDA.

Parts (one JSON line each):

- ``logits.<family>``: a ~0.5B-shaped random Qwen3 and Llama (built from a config, nothing
  downloaded): the engine's bf16 logits on every prompt position against transformers' own
  bf16 forward, both measured against transformers in fp32. Passes when the engine is no
  further from fp32 than 2x transformers' bf16 error (plus 0.01) and agrees with it on the
  argmax at >= 90% of positions.
- ``decode.<family>``: decode tokens/s at batch 1, 32 and 256 (a 16-token prompt per slot).
- ``pool``: a sampler pool, one SamplerActor process per visible GPU, generates, and its GPU
  names pass the pool's label check (CUDA only).

Run: ``python scripts/gpu_checks/sampler_cuda.py`` on a GPU machine (``bash scripts/gpu_check.sh``
runs it with a time limit); ``--device cpu --tiny`` is a dry run of the same logic.
"""

from __future__ import annotations

import torch
from _common import Report, parse_args, peak_mib, sync, timed

SHAPES = {
    # Qwen3-0.6B's shape
    "qwen3": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=3072, vocab_size=151936),
    # a Llama-3 block at ~0.5B
    "llama": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=64, intermediate_size=4096, vocab_size=32000),
}  # fmt: skip


def config(family: str, tiny: bool) -> dict:
    from actors.models import default_model_config

    cfg = default_model_config(128 if tiny else SHAPES[family]["vocab_size"])
    if not tiny:
        cfg.update(SHAPES[family])
    cfg["model_type"] = family
    cfg["max_position_embeddings"] = 512
    if family == "llama":
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    return cfg


def logits_part(rep: Report, family: str, cfg: dict, device: str, model, snap: dict) -> None:
    from actors.sampler import DecoderEngine

    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, cfg["vocab_size"], (4, 64), generator=gen)
    with torch.no_grad():
        ref = model.to(device)(prompts.to(device)).logits.float()
        hf16 = model.to(torch.bfloat16)(prompts.to(device)).logits.float()
    eng = DecoderEngine(cfg, max_slots=4, device=device, compute_dtype=torch.bfloat16)
    eng.load(snap)
    got = eng.prefill(list(range(4)), prompts.tolist(), all_logits=True).float()

    def rel(a: torch.Tensor) -> float:
        return float((a - ref).norm() / ref.norm())

    err_engine, err_hf = rel(got), rel(hf16)
    agree = float((got.argmax(-1) == hf16.argmax(-1)).float().mean())
    ok = err_engine <= 2 * err_hf + 0.01 and agree >= 0.9
    rep.part(f"logits.{family}", ok, engine_rel_err_fp32=err_engine, hf_bf16_rel_err_fp32=err_hf, argmax_agree=agree)


def decode_part(rep: Report, family: str, cfg: dict, device: str, snap: dict, batches: list[int], steps: int) -> None:
    from actors.sampler import DecoderEngine

    eng = DecoderEngine(cfg, max_slots=max(batches), max_len=16 + 2 * steps + 8, device=device)
    eng.load(snap)
    rates = {}
    for b in batches:
        slots = list(range(b))
        eng.prefill(slots, [[1 + (i + j) % 100 for j in range(16)] for i in slots])
        sync(device)
        toks = [7] * b

        def run(slots: list[int] = slots, toks: list[int] = toks) -> None:
            for _ in range(steps):
                eng.decode(slots, toks)

        sec = timed(run, device, reps=1)
        rates[f"batch_{b}_tokens_per_s"] = b * steps / sec
        for s in slots:
            eng.truncate(s, 16)
    rep.part(f"decode.{family}", all(r > 0 for r in rates.values()), steps=steps, peak_mib=peak_mib(device), **rates)


async def pool_part(rep: Report) -> None:
    from actors.sampler import GenerateRequest, SamplerActor
    from hardware import detected_gpu, gpu_mismatch
    from orchestrator.runtime import open_mesh

    n = torch.cuda.device_count()
    label = detected_gpu(torch.cuda.get_device_name(0)) or "H100-SXM"
    async with open_mesh(
        SamplerActor, "gpu-pool", "bf16", None, "cuda", init_seed=0, gpus=list(range(n)), procs=n, name="sampler-gpu"
    ) as mesh:
        names = [x for rank in await mesh.device_names.call() for x in rank]
        res = await mesh[0].generate.call_one(GenerateRequest(request_id="g", prompt_ids=[1, 2], max_new_tokens=8))
    rep.part("pool", len(names) == n and len(res.token_ids) > 0, devices=names)
    rep.part("pool.label_check", gpu_mismatch("gpu-pool", label, names) is None, label=label)


if __name__ == "__main__":
    args = parse_args(__doc__)
    rep = Report("sampler_cuda")
    batches = [1, 4] if args.tiny else [1, 32, 256]
    steps = 4 if args.tiny else 32
    from actors.models import build_model, model_weights
    from orchestrator.weightsync import wire_snapshot

    for fam in ("qwen3", "llama"):
        cfg = config(fam, args.tiny)
        model = build_model(cfg, seed=0)
        snap = wire_snapshot(model_weights(model), "bf16")
        rep.guard(f"logits.{fam}", logits_part, rep, fam, cfg, args.device, model, snap)
        del model
        if not args.quick or fam == "qwen3":
            rep.guard(f"decode.{fam}", decode_part, rep, fam, cfg, args.device, snap, batches, steps)
        del snap
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.device.startswith("cuda"):
        import trio

        rep.guard("pool", trio.run, pool_part, rep)
    else:
        rep.skip("pool", "CPU dry run: the pool part pins one GPU per rank")
    rep.exit()
