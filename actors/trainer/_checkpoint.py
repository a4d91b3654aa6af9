"""Trainer checkpoints: safetensors for tensors, JSON for scalars. No pickle, no torch.load.

Layout of a checkpoint directory::

    model/config.json          the model config, loadable by actors.models.build_model
    model/model.safetensors    fp32 master weights, HF parameter names
    optimizer.safetensors      AdamW state, flattened: "exp_avg/<param>", "exp_avg_sq/<param>",
                               "step/<param>"; and "rng/torch_cpu" (uint8 generator state),
                               "rng/torch_cuda" when on CUDA
    trainer.json               format, version, param order, trainer config; written LAST, so
                               a directory without it is an incomplete checkpoint

Resuming restores all of it, so the next step is bit-exact to the one the saving
trainer would have taken (same config, same batch, same thread count).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from orchestrator.checkpoints import write_file_atomic

if TYPE_CHECKING:
    from actors.trainer._core import Trainer

__all__ = ["checkpoint_format", "is_complete", "load_state", "model_dir", "read_meta", "save"]

FORMAT = "flotilla.trainer/1"
SHARDED_FORMAT = "flotilla.trainer/2"   # written by actors.trainer._dcp
_MOMENTS = ("exp_avg", "exp_avg_sq", "step")


def save(trainer: Trainer, directory: str) -> str:
    """Write ``trainer``'s full state under ``directory`` (created); returns its path."""
    root = Path(directory)
    (root / "model").mkdir(parents=True, exist_ok=True)
    done = root / "trainer.json"
    if done.exists():
        done.unlink()   # the directory is incomplete until the new trainer.json lands
    cfg = trainer.model_config
    # trainer.json is written last, atomically: the directory is a checkpoint only once it
    # is there, so the files before it need no care of their own.
    (root / "model" / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
    weights = {n: t.detach().to("cpu", torch.float32).contiguous()
               for n, t in trainer.model.state_dict().items()}
    if trainer.model.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)   # the embedding itself (safetensors refuses aliases)
    save_file(weights, str(root / "model" / "model.safetensors"), metadata={"format": "pt"})

    opt: dict[str, torch.Tensor] = {}
    for name, p in trainer.params.items():
        state = trainer.optimizer.state.get(p, {})
        for key in _MOMENTS:
            if key in state:
                opt[f"{key}/{name}"] = state[key].detach().to("cpu").contiguous()
    opt["rng/torch_cpu"] = torch.get_rng_state()
    if trainer.device.type == "cuda":
        opt["rng/torch_cuda"] = torch.cuda.get_rng_state(trainer.device)
    save_file(opt, str(root / "optimizer.safetensors"))

    meta = {"format": FORMAT, "version": trainer.version, "params": list(trainer.params),
            "config": trainer.config.model_dump(mode="json")}
    write_file_atomic(done, json.dumps(meta, indent=1).encode())
    return str(root)


def is_complete(directory: str) -> bool:
    """Whether `directory` holds a whole checkpoint (its trainer.json, written last)."""
    return (Path(directory) / "trainer.json").is_file()


def read_meta(directory: str) -> dict[str, Any]:
    path = Path(directory) / "trainer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a complete trainer checkpoint "
                                "(no trainer.json)")
    meta = json.loads(path.read_text())
    if meta.get("format") not in (FORMAT, SHARDED_FORMAT):
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r} "
                         f"or {SHARDED_FORMAT!r}")
    return meta


def checkpoint_format(directory: str) -> str:
    """The format of a complete checkpoint (FileNotFoundError for an incomplete one)."""
    return str(read_meta(directory)["format"])


def model_dir(directory: str) -> str:
    """The model directory of a complete checkpoint (FileNotFoundError otherwise)."""
    read_meta(directory)
    return str(Path(directory) / "model")


def load_state(trainer: Trainer, directory: str) -> int:
    """Restore optimizer state and RNG into ``trainer`` (whose model was built from
    ``model_dir(directory)``); returns the checkpoint's version.

    Raises ValueError naming the tensor when the optimizer state does not match the
    model's parameters.
    """
    meta = read_meta(directory)
    if meta["format"] != FORMAT:
        raise ValueError(f"{directory}: format {meta['format']!r} is not a single-process checkpoint")
    if meta["params"] != list(trainer.params):
        raise ValueError(f"{directory}: parameter names/order differ from the model's")
    state = load_file(str(Path(directory) / "optimizer.safetensors"))
    for name, p in trainer.params.items():
        entry: dict[str, torch.Tensor] = {}
        for key in _MOMENTS:
            t = state.pop(f"{key}/{name}", None)
            if t is not None:
                if key != "step" and t.shape != p.shape:
                    raise ValueError(f"{directory}: optimizer tensor {key}/{name} has shape "
                                     f"{tuple(t.shape)}, parameter {tuple(p.shape)}")
                entry[key] = t.to(p.device) if key != "step" else t
        if entry:
            if set(entry) != set(_MOMENTS):
                raise ValueError(f"{directory}: optimizer state of {name} has {sorted(entry)}, "
                                 f"expected {list(_MOMENTS)}")
            trainer.optimizer.state[p] = entry
    rng = state.pop("rng/torch_cpu", None)
    if rng is None:
        raise ValueError(f"{directory}: optimizer.safetensors lacks rng/torch_cpu")
    torch.set_rng_state(rng)
    cuda_rng = state.pop("rng/torch_cuda", None)
    if cuda_rng is not None and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(cuda_rng, trainer.device)
    if state:
        raise ValueError(f"{directory}: unknown optimizer tensors {sorted(state)[:5]}")
    return int(meta["version"])
