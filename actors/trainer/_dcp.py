"""Checkpoints of the FSDP2 trainer: ``torch.distributed.checkpoint`` (DCP), any rank count.

Layout of a sharded checkpoint directory::

    model/config.json      the model config (the weights are in state/)
    state/                 DCP: "model" (parameters by FQN; LoRA: base + adapters) and
                           "optim" (AdamW exp_avg / exp_avg_sq / step per trained parameter),
                           each rank writing its shards
    rng.safetensors        rank 0's torch CPU generator state (uint8)
    trainer.json           format "flotilla.trainer/2", version, trained parameter names,
                           trainer config, ranks that wrote it; written LAST by rank 0

DCP stores where each shard lives, so a checkpoint written by N ranks loads into M ranks,
and into a single-process trainer (``dcp.load`` without a process group). Only tensors
are saved: the optimizer's hyperparameters come from the config, as in
``flotilla.trainer/1``. DCP's own ``state/.metadata`` index is written by torch with
pickle: resume only from checkpoints you wrote. A single-process checkpoint
(``flotilla.trainer/1``) also loads here: its weights were read when the model was built,
its Adam state is scattered from the full tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save as safetensors_bytes
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from actors.models import read_tensors
from actors.trainer._checkpoint import FORMAT as SINGLE_FORMAT
from actors.trainer._checkpoint import SHARDED_FORMAT as FORMAT
from actors.trainer._checkpoint import read_meta
from orchestrator.state.checkpoints import CheckpointError, write_file_atomic

if TYPE_CHECKING:
    from actors.trainer._core import Trainer

__all__ = ["FORMAT", "load", "save"]

_MOMENTS = ("exp_avg", "exp_avg_sq", "step")


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save(trainer: Trainer, directory: str) -> str:
    """Write ``trainer``'s state under ``directory`` with every rank (a collective)."""
    root = Path(directory)
    main = trainer.world.is_main
    if main:
        (root / "model").mkdir(parents=True, exist_ok=True)
        if (root / "trainer.json").exists():
            (root / "trainer.json").unlink()  # incomplete until the new one lands
        write_file_atomic(
            root / "model" / "config.json", json.dumps(trainer.model_config, indent=1, sort_keys=True).encode()
        )
    _barrier()
    osd = get_optimizer_state_dict(trainer.model, trainer.optimizer)
    state = {"model": get_model_state_dict(trainer.model), "optim": osd["state"]}
    dcp.save(state, checkpoint_id=str(root / "state"))
    if main:
        write_file_atomic(root / "rng.safetensors", safetensors_bytes({"torch_cpu": torch.get_rng_state()}))
        meta = {
            "format": FORMAT,
            "version": trainer.version,
            "params": list(trainer.params),
            "ranks": trainer.world.size,
            "config": trainer.config.model_dump(mode="json"),
        }
        write_file_atomic(root / "trainer.json", json.dumps(meta, indent=1).encode())
    _barrier()
    return str(root)


def load(trainer: Trainer, directory: str) -> int:
    """Restore weights, Adam state and RNG into ``trainer`` (built from the checkpoint's
    model config and already sharded); every rank calls it. Returns the version.

    Raises CheckpointError when the trained parameters differ from the checkpoint's (e.g. a
    different LoRA config) or a file cannot be read; DCP raises naming a missing tensor
    (the caller wraps it in ``_checkpoint.loading``).
    """
    meta = read_meta(directory)
    if meta["params"] != list(trainer.params):
        raise CheckpointError(
            f"{directory}: trained parameters differ from the checkpoint's "
            f"({len(meta['params'])} there, {len(trainer.params)} here; "
            "same model and LoRA settings?)"
        )
    if meta["format"] == SINGLE_FORMAT:
        _load_single(trainer, directory)
        return int(meta["version"])
    osd = get_optimizer_state_dict(trainer.model, trainer.optimizer)  # creates empty moments
    state: dict[str, Any] = {"model": get_model_state_dict(trainer.model), "optim": osd["state"]}
    dcp.load(state, checkpoint_id=str(Path(directory) / "state"))
    set_model_state_dict(trainer.model, state["model"])
    set_optimizer_state_dict(
        trainer.model, trainer.optimizer, {"state": state["optim"], "param_groups": osd["param_groups"]}
    )
    torch.set_rng_state(read_tensors(Path(directory) / "rng.safetensors")["torch_cpu"])
    return int(meta["version"])


def _load_single(trainer: Trainer, directory: str) -> None:
    flat = read_tensors(Path(directory) / "optimizer.safetensors")
    full = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=StateDictOptions(full_state_dict=True))
    for name in trainer.params:
        full["state"][name] = {k: flat[f"{k}/{name}"] for k in _MOMENTS}
    set_optimizer_state_dict(trainer.model, trainer.optimizer, full, options=StateDictOptions(full_state_dict=True))
    torch.set_rng_state(flat["rng/torch_cpu"])
