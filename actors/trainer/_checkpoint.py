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

Errors: a checkpoint that cannot be loaded (an unreadable header or JSON file,
non-finite values, tensors whose names or shapes differ from the model's) raises
``CheckpointError`` with one line naming the file and the problem (``loading`` turns any
other loader error into one).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from actors.models import read_tensors
from orchestrator.runtime import clip
from orchestrator.state.checkpoints import CheckpointError, write_file_atomic

if TYPE_CHECKING:
    from actors.trainer._core import Trainer

__all__ = ["checkpoint_format", "is_complete", "load_state", "loading", "model_dir", "read_meta", "save"]

FORMAT = "flotilla.trainer/1"
SHARDED_FORMAT = "flotilla.trainer/2"  # written by actors.trainer._dcp
_MOMENTS = ("exp_avg", "exp_avg_sq", "step")


def save(trainer: Trainer, directory: str) -> str:
    """Write ``trainer``'s full state under ``directory`` (created); returns its path."""
    root = Path(directory)
    (root / "model").mkdir(parents=True, exist_ok=True)
    done = root / "trainer.json"
    if done.exists():
        done.unlink()  # the directory is incomplete until the new trainer.json lands
    cfg = trainer.model_config
    # trainer.json is written last, atomically: the directory is a checkpoint only once it
    # is there, so the files before it need no care of their own.
    (root / "model" / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
    weights = {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in trainer.model.state_dict().items()}
    if trainer.model.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # the embedding itself (safetensors refuses aliases)
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

    meta = {
        "format": FORMAT,
        "version": trainer.version,
        "params": list(trainer.params),
        "config": trainer.config.model_dump(mode="json"),
    }
    write_file_atomic(done, json.dumps(meta, indent=1).encode())
    return str(root)


def is_complete(directory: str) -> bool:
    """Whether `directory` holds a whole checkpoint (its trainer.json, written last)."""
    return (Path(directory) / "trainer.json").is_file()


@contextmanager
def loading(directory: str) -> Iterator[None]:
    """Inside, any error but CheckpointError becomes one: one line naming `directory` and
    the error (a loader's own exception types are many: json, safetensors, torch)."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:  # the loaders' many error types: one line naming the checkpoint
        text = str(e).strip()
        problem = f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
        raise CheckpointError(f"{directory}: cannot be loaded: {clip(problem)}") from e


def read_meta(directory: str) -> dict[str, Any]:
    path = Path(directory) / "trainer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a complete trainer checkpoint (no trainer.json)")
    try:
        meta = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path}: cannot be read: {clip(e)}") from None
    if not isinstance(meta, dict) or meta.get("format") not in (FORMAT, SHARDED_FORMAT):
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{path}: format {found!r}, expected {FORMAT!r} or {SHARDED_FORMAT!r}")
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

    Raises CheckpointError naming the file and tensor when the optimizer state does not
    match the model's parameters or holds non-finite values.
    """
    meta = read_meta(directory)
    if meta["format"] != FORMAT:
        raise CheckpointError(f"{directory}: format {meta['format']!r} is not a single-process checkpoint")
    if meta["params"] != list(trainer.params):
        raise CheckpointError(f"{directory}: parameter names/order differ from the model's")
    path = Path(directory) / "optimizer.safetensors"
    state = read_tensors(path)
    for name, p in trainer.params.items():
        entry: dict[str, torch.Tensor] = {}
        for key in _MOMENTS:
            t = state.pop(f"{key}/{name}", None)
            if t is not None:
                if key != "step" and t.shape != p.shape:
                    raise CheckpointError(
                        f"{path}: optimizer tensor {key}/{name} has shape {tuple(t.shape)}, parameter {tuple(p.shape)}"
                    )
                entry[key] = t.to(p.device) if key != "step" else t
        if entry:
            if set(entry) != set(_MOMENTS):
                raise CheckpointError(
                    f"{path}: optimizer state of {name} has {sorted(entry)}, expected {list(_MOMENTS)}"
                )
            trainer.optimizer.state[p] = entry
    rng = state.pop("rng/torch_cpu", None)
    if rng is None:
        raise CheckpointError(f"{path}: lacks rng/torch_cpu")
    torch.set_rng_state(rng)
    cuda_rng = state.pop("rng/torch_cuda", None)
    if cuda_rng is not None and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(cuda_rng, trainer.device)
    if state:
        raise CheckpointError(f"{path}: unknown optimizer tensors {sorted(state)[:5]}")
    return int(meta["version"])
