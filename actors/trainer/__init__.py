"""The trainer: fp32 master weights, AdamW, the recipe loss, weight publishing, checkpoints.

``open_trainer`` spawns ``TrainerConfig.procs`` ranks (FSDP2 over torch.distributed when
more than one) and yields a ``TrainerGroup``, the one trainer link the controller drives;
``TrainerActor`` is one rank, and what the controller drives (``train_step``, ``updates_for``,
``ack``, ``version``, ``keyframe``, ``save_checkpoint``); ``Trainer`` is the same
training logic as a plain in-process object. ``sft_step`` and ``tokenize_records`` are the
supervised warm start (``actors.trainer._sft``).
"""

from actors.trainer._actor import TrainerActor
from actors.trainer._config import LoraConfig, StepResult, TrainerConfig
from actors.trainer._core import Trainer
from actors.trainer._group import (
    TrainerGroup,
    TrainerRankDied,
    open_trainer,
    trainer_mesh,
)
from actors.trainer._memory import memory_line
from actors.trainer._sft import SftDataError, SftResult, SftSequence, tokenize_records

__all__ = [
    "LoraConfig",
    "SftDataError",
    "SftResult",
    "SftSequence",
    "StepResult",
    "Trainer",
    "TrainerActor",
    "TrainerConfig",
    "TrainerGroup",
    "TrainerRankDied",
    "memory_line",
    "open_trainer",
    "tokenize_records",
    "trainer_mesh",
]
