"""Sampler throughput: Flotilla's torch backend vs transformers' ``generate``.

What: tokens/s of the sampler engine (``actors.sampler``: lean Qwen3 forward,
slot KV cache, continuous batching, top-k/top-p sampling with support records
through ``policies``) against ``Qwen3ForCausalLM.generate`` on the same tiny
model (same float32 weights), same prompts, same number of new tokens,
sampling on (temperature 1, top-k 64, top-p 0.97), KV cache on, on CPU.

Why: the sampler must not be slower than the reference implementation it
replaces, while also recording every token's support and version.

Multi-turn case: ``--sessions`` conversations of 8 turns each (a
``--system``-token prompt -- an agent's instructions and tool schemas --, then per
turn ``--turn-tokens`` generated tokens and 24 new user/tool tokens), all sessions stepping together, with the session prefix cache
on (a turn prefills only its new tokens) and off (every turn prefills the whole
conversation); ``multiturn_speedup`` is the ratio of their wall times.

How:  python benchmarks/sampler.py            (64 prompts x 32 new tokens, 5 repeats)
      python benchmarks/sampler.py --quick    (2 repeats, < 60 s)
Both sides use one thread (``--threads``).  Prompts have random lengths in
[8, 24]; HF gets them left-padded with an attention mask, Flotilla as they are.
The median wall time over the repeats counts (after one warm-up run each).
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64, help="prompts in the batch")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per side")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--sessions", type=int, default=16, help="multi-turn case: concurrent conversations")
    ap.add_argument("--system", type=int, default=1024, help="multi-turn case: tokens of the first prompt")
    ap.add_argument("--turn-tokens", type=int, default=8, help="multi-turn case: tokens generated per turn")
    ap.add_argument("--quick", action="store_true", help="2 repeats (< 60 s)")
    args = ap.parse_args()
    if args.quick:
        args.repeats = 2

    import torch

    torch.set_num_threads(args.threads)
    from actors.models import build_model, default_model_config, model_weights
    from actors.sampler import ContinuousBatcher, GenerateRequest, Qwen3Engine

    cfg = default_model_config()
    model = build_model(cfg, seed=0)
    weights = model_weights(model)
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, cfg["vocab_size"], (int(torch.randint(8, 25, (1,), generator=g)),), generator=g).tolist()
        for _ in range(args.prompts)
    ]
    sampling = dict(temperature=1.0, top_k=64, top_p=0.97)
    n_tokens = args.prompts * args.new_tokens

    batcher = ContinuousBatcher(Qwen3Engine(cfg, max_slots=args.prompts), pool="bench", seed=0)
    batcher.set_weights(weights, version=0)

    def flotilla() -> int:
        for i, p in enumerate(prompts):
            batcher.submit(GenerateRequest(request_id=str(i), prompt_ids=p, max_new_tokens=args.new_tokens, **sampling))
        made = 0
        while batcher.has_work():
            made += sum(len(r.token_ids) for r in batcher.step())
        return made

    width = max(len(p) for p in prompts)
    ids = torch.zeros(args.prompts, width, dtype=torch.long)
    mask = torch.zeros(args.prompts, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1

    def hf_generate() -> int:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=0,
                eos_token_id=None,
                use_cache=True,
                **sampling,
            )
        return (out.shape[1] - width) * args.prompts

    def timed(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            made = fn()
            times.append(time.perf_counter() - t0)
            if made != n_tokens:
                raise RuntimeError(f"{fn.__name__} made {made} tokens, expected {n_tokens}")
        return statistics.median(times)

    ours, hf = timed(flotilla), timed(hf_generate)
    print(
        f"flotilla: {n_tokens / ours:,.0f} tok/s ({ours * 1e3:.1f} ms)   "
        f"hf generate: {n_tokens / hf:,.0f} tok/s ({hf * 1e3:.1f} ms)"
    )
    multi = {mode: multiturn(args, cache=mode == "reuse") for mode in ("reuse", "recompute")}
    for mode, (wall, prefilled) in multi.items():
        print(
            f"multi-turn, prefix cache {'on ' if mode == 'reuse' else 'off'}: {wall * 1e3:8.1f} ms, "
            f"{prefilled:7d} prompt tokens computed"
        )
    speedup = multi["recompute"][0] / multi["reuse"][0]
    print(f"multi-turn speedup: {speedup:.2f}x")
    print(
        json.dumps(
            {
                "benchmark": "sampler",
                "prompts": args.prompts,
                "new_tokens": args.new_tokens,
                "threads": args.threads,
                "repeats": args.repeats,
                "flotilla_tok_s": round(n_tokens / ours, 1),
                "hf_generate_tok_s": round(n_tokens / hf, 1),
                "ratio": round(hf / ours, 3),
                "multiturn_sessions": args.sessions,
                "multiturn_turns": 8,
                "multiturn_system_tokens": args.system,
                "multiturn_turn_tokens": args.turn_tokens,
                "multiturn_reuse_ms": round(multi["reuse"][0] * 1e3, 1),
                "multiturn_recompute_ms": round(multi["recompute"][0] * 1e3, 1),
                "multiturn_prompt_tokens_reuse": multi["reuse"][1],
                "multiturn_prompt_tokens_recompute": multi["recompute"][1],
                "multiturn_speedup": round(speedup, 2),
            }
        )
    )


def multiturn(args, *, cache: bool, turns: int = 8, user_tokens: int = 24) -> tuple[float, int]:
    """8-turn conversations, all sessions stepping together; (median wall seconds, prompt
    tokens prefilled in one run)."""
    import torch

    from actors.models import build_model, default_model_config, model_weights
    from actors.sampler import ContinuousBatcher, GenerateRequest, Qwen3Engine

    gen_tokens = args.turn_tokens
    cfg = default_model_config()
    cfg["max_position_embeddings"] = args.system + turns * (gen_tokens + user_tokens) + 8
    weights = model_weights(build_model(cfg, seed=0))
    g = torch.Generator().manual_seed(2)
    vocab = cfg["vocab_size"]
    first = [torch.randint(0, vocab, (args.system,), generator=g).tolist() for _ in range(args.sessions)]
    users = [
        [torch.randint(0, vocab, (user_tokens,), generator=g).tolist() for _ in range(turns)]
        for _ in range(args.sessions)
    ]
    batcher = ContinuousBatcher(Qwen3Engine(cfg, max_slots=args.sessions), pool="bench", seed=0, prefix_cache=cache)
    batcher.set_weights(weights, version=0)

    def run(tag: str) -> int:
        before = batcher.prompt_tokens
        convo = [list(p) for p in first]
        for t in range(turns):
            for i in range(args.sessions):
                batcher.submit(
                    GenerateRequest(
                        request_id=f"{tag}/{i}/{t}",
                        prompt_ids=convo[i],
                        max_new_tokens=gen_tokens,
                        seed=1000 * i + t,
                        session_id=f"{tag}/{i}",
                    )
                )
            done = {}
            while batcher.has_work():
                done.update((r.request_id, r) for r in batcher.step())
            for i in range(args.sessions):
                convo[i] = convo[i] + done[f"{tag}/{i}/{t}"].token_ids + users[i][t]
        for i in range(args.sessions):
            batcher.drop_session(f"{tag}/{i}")
        return batcher.prompt_tokens - before

    run("warm")
    times, prefilled = [], 0
    for r in range(args.repeats):
        t0 = time.perf_counter()
        prefilled = run(f"r{r}")
        times.append(time.perf_counter() - t0)
    return statistics.median(times), prefilled


if __name__ == "__main__":
    main()
