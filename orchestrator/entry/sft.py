"""`flotilla sft CONFIG`: supervised fine-tuning as a warm start for RL.

Reads the run config's `[sft]` table, renders its JSONL data with the run's chat format
(`actors.trainer.tokenize_records`: loss on assistant tokens only), and trains the run's
model with the run's trainer actor (`TrainerActor.sft_step`: token-mean cross-entropy,
AdamW, gradient clipping as in RL). The output directory (`<run_root>/<sft.name>`,
default `<name>-sft`) holds:

    config.json        the resolved config
    metrics.jsonl      one line per SFT step: step, epoch, loss, tokens, grad_norm, lr, wall_s
    sft_summary.json   the data's mean NLL per assistant token before and after, steps, tokens
    checkpoint/        the trainer checkpoint (the format `flotilla run` writes); its
                       `model/` (config.json, model.safetensors and, for a model directory
                       with a tokenizer, that tokenizer) is what a run's `[model] path` takes

A run then starts from it: `flotilla run CONFIG --set model.path=runs/<name>-sft/checkpoint/model`
(weights from the SFT checkpoint; a fresh optimizer and version 0, like any `[model] path`).

Errors: a config without `[sft]`, a missing data file, or a bad record (one line naming the
file and the line) raise ConfigError before any process starts. Cancellation (Ctrl-C) stops
the trainer process; a checkpoint is written only when every step is done.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from orchestrator.state.checkpoints import save_checkpoint_dir
from orchestrator.state.config import ConfigError, RunConfig, load_config
from orchestrator.state.telemetry import MetricsLog

__all__ = ["SftOutcome", "run_sft", "sft_from_cli", "sft_output_dir"]


@dataclass
class SftOutcome:
    out_dir: Path
    """The output directory (see the module docstring)."""
    model_dir: Path
    """`checkpoint/model`: the `[model] path` of a run that starts from this SFT."""
    steps: int
    initial_loss: float
    """Mean NLL per assistant token of the whole data set before the first step (nats)."""
    final_loss: float
    """The same after the last step."""
    wall_s: float


def sft_output_dir(cfg: RunConfig) -> Path:
    """Where `flotilla sft` writes for `cfg` (`[sft] name`, default `<name>-sft`)."""
    return Path(cfg.run_root) / (cfg.sft.name or f"{cfg.name}-sft")


def _prepare(cfg: RunConfig, source: str) -> tuple[list[Any], Any]:
    """The tokenized data and the chat format; ConfigError naming the field or the line."""
    from actors.chat import load_chat_format
    from actors.trainer import SftDataError, tokenize_records

    if cfg.sft.data is None:
        raise ConfigError(
            f"{source}: no [sft] table with data; give at least sft.data (a JSONL of chats or prompt/completion pairs)"
        )
    if not Path(cfg.sft.data).is_file():
        raise ConfigError(f"{source}: sft.data {cfg.sft.data!r}: no such file")
    if cfg.model.path is not None and not Path(cfg.model.path).is_dir():
        raise ConfigError(f"{source}: model.path {cfg.model.path!r}: no such directory")
    try:
        fmt = load_chat_format(cfg.model.path, cfg.model.chat_template_kwargs)
        data = tokenize_records(cfg.sft.data, fmt, cfg.model.max_seq_len)
    except SftDataError as e:
        raise ConfigError(str(e)) from None
    except ValueError as e:
        raise ConfigError(f"{source}: model.path {cfg.model.path!r}: tokenizer: {e}") from None
    return data, fmt


def _batches(n: int, batch_size: int, steps: int, seed: int) -> list[tuple[int, list[int]]]:
    """(epoch, indices) of each step: every epoch a fresh permutation, cut into batches
    (the last batch of an epoch may be smaller)."""
    out: list[tuple[int, list[int]]] = []
    epoch = 0
    while len(out) < steps:
        order = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        for i in range(0, n, batch_size):
            out.append((epoch, order[i : i + batch_size]))
            if len(out) == steps:
                break
        epoch += 1
    return out


async def _mean_loss(trainer: Any, data: list[Any], chunk: int) -> float:
    total = tokens = 0.0
    for i in range(0, len(data), chunk):
        r = await trainer.sft_evaluate(data[i : i + chunk])
        total, tokens = total + r.loss * r.tokens, tokens + r.tokens
    return total / tokens


async def sft_async(cfg: RunConfig, *, source: str = "<config>", quiet: bool = False) -> SftOutcome:
    """Run `cfg`'s `[sft]` (see the module docstring)."""
    from actors.chat import HFChatFormat
    from actors.trainer import open_trainer
    from orchestrator.entry.runner import actor_env, run_model_config

    t0 = time.monotonic()
    data, fmt = _prepare(cfg, source)
    sft = cfg.sft
    out = sft_output_dir(cfg)
    if (out / "checkpoint").exists() or (out / "metrics.jsonl").exists():
        raise ConfigError(f"{out}: an SFT output exists there; remove it or set sft.name")
    lr = sft.lr if sft.lr is not None else cfg.trainer.lr
    steps = sft.steps if sft.steps is not None else sft.epochs * math.ceil(len(data) / sft.batch_size)
    plan = _batches(len(data), sft.batch_size, steps, cfg.seed)
    trainer_cfg = cfg.trainer.model_copy(
        update={"recipe": cfg.recipe, "seed": cfg.model.seed, "model": run_model_config(cfg), "precisions": ["bf16"]}
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.resolved_json())
    say = (lambda _m: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    say(f"flotilla sft: {len(data)} sequences, {steps} steps at lr {lr:g} → {out}")
    chunk = max(sft.batch_size, 64)
    async with open_trainer(trainer_cfg, name="sft-trainer", env=actor_env(cfg, cfg.placement.trainer_cpus)) as tr:
        initial = await _mean_loss(tr, data, chunk)
        say(f"flotilla sft: initial loss {initial:.4f}")
        log = MetricsLog(out / "metrics.jsonl")
        try:
            for k, (epoch, idx) in enumerate(plan, start=1):
                r = await tr.sft_step([data[i] for i in idx], lr)
                log.write(
                    {
                        "step": k,
                        "epoch": epoch,
                        "loss": r.loss,
                        "tokens": r.tokens,
                        "grad_norm": r.grad_norm,
                        "applied": r.applied,
                        "lr": lr,
                        "wall_s": round(time.monotonic() - t0, 3),
                    }
                )
                if k == steps or k % max(1, steps // 10) == 0:
                    say(f"flotilla sft: step {k}/{steps} epoch {epoch} loss {r.loss:.4f}")
        finally:
            log.close()
        final = await _mean_loss(tr, data, chunk)

        async def write(staging: Path) -> None:
            await tr.save_checkpoint(str(staging))
            if isinstance(fmt, HFChatFormat):  # the run reads its chat template from model/
                fmt.tokenizer.save_pretrained(str(staging / "model"))

        await save_checkpoint_dir(out, write, meta={"step": steps, "sft": True}, name="checkpoint")
    outcome = SftOutcome(out, out / "checkpoint" / "model", steps, initial, final, time.monotonic() - t0)
    summary = {
        "sequences": len(data),
        "loss_tokens": sum(s.num_loss_tokens for s in data),
        "steps": steps,
        "lr": lr,
        "initial_loss": initial,
        "final_loss": final,
        "wall_s": round(outcome.wall_s, 3),
        "model_path": str(outcome.model_dir),
    }
    (out / "sft_summary.json").write_text(json.dumps(summary, indent=1))
    say(
        f"flotilla sft: loss {initial:.4f} → {final:.4f}; start a run from it with --set model.path={outcome.model_dir}"
    )
    return outcome


def run_sft(cfg: RunConfig, *, source: str = "<config>", quiet: bool = False) -> SftOutcome:
    """`sft_async` in a fresh trio loop."""
    return trio.run(lambda: sft_async(cfg, source=source, quiet=quiet))


def sft_from_cli(config: str, overrides: list[str], quiet: bool = False) -> int:
    cfg = load_config(config, overrides)
    run_sft(cfg, source=config, quiet=quiet)
    return 0
