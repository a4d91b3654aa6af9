"""GPU check: an SGLang pool for real -- launch `python -m sglang.launch_server` on a tiny
random Qwen3 checkpoint (written here, nothing downloaded) through Flotilla's SGLang backend,
generate with return_sampling_mask (rows must be valid supports), update the weights from
disk with a version, generate again. Skipped (exit 0) when sglang is not installed.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import trio


def report(part: str, status: str, **fields: object) -> None:
    print(json.dumps({"check": f"sglang_pool.{part}", "status": status, **fields}), flush=True)


async def main(ckpt: Path) -> bool:
    from actors.models import build_model, default_model_config, model_weights
    from actors.sampler import GenerateRequest
    from actors.sampler._sglang import SGLangBackend
    from orchestrator.weightsync import wire_snapshot

    cfg = default_model_config(vocab_size=1024)
    model = build_model(cfg, seed=0)
    model.save_pretrained(ckpt)
    launch = {
        "model_path": str(ckpt),
        "args": ["--disable-radix-cache", "--skip-tokenizer-init"],
        "port": 31000,
        "health_timeout_s": 150,  # within the check's budget in scripts/gpu_check.sh
    }
    be = SGLangBackend(pool="gpu", model_config=cfg, launch=launch, port=31000, gpu=0)
    ok = True
    async with trio.open_nursery() as nursery:
        await nursery.start(be.run)
        await be.update_weights(wire_snapshot(model_weights(model), "bf16"), 1)
        req = GenerateRequest(request_id="a", prompt_ids=[1, 2, 3], max_new_tokens=16, top_k=20, min_version=1)
        try:
            res = await be.generate(req)
            res.support().token_index(torch.tensor(res.token_ids))  # each token lies in its row
            report("generate_with_sampling_mask", "passed", tokens=len(res.token_ids), versions=res.versions[:1])
        except Exception as exc:
            report("generate_with_sampling_mask", "failed", error=repr(exc))
            ok = False
        await be.update_weights(wire_snapshot(model_weights(build_model(cfg, seed=1)), "bf16"), 2)
        res = await be.generate(req.model_copy(update={"request_id": "b", "min_version": 2}))
        good = res.versions and res.versions[0] == 2
        report("update_from_disk_with_version", "passed" if good else "failed", versions=res.versions[:1])
        ok = ok and bool(good)
        nursery.cancel_scope.cancel()
    return ok


if __name__ == "__main__":
    if "cpu" in sys.argv[1:]:
        report("launch", "skipped", reason="CPU dry run: SGLang serves on a GPU")
        sys.exit(0)
    try:
        import sglang  # noqa: F401
    except ImportError:
        report("launch", "skipped", reason="sglang is not installed (pip install -e '.[sglang]')")
        sys.exit(0)
    with tempfile.TemporaryDirectory() as d:
        sys.exit(0 if trio.run(main, Path(d)) else 1)
