"""The trainer: fp32 master weights, AdamW, the recipe loss, weight publishing, checkpoints.

``open_trainer`` spawns ``TrainerConfig.procs`` ranks (FSDP2 over torch.distributed when
more than one) and yields a ``TrainerGroup``, the one trainer link the controller drives;
``TrainerActor`` is one rank, and what the controller drives (``train_step``, ``updates_for``,
``ack``, ``version``, ``keyframe``, ``save_checkpoint``); ``Trainer`` is the same
training logic as a plain in-process object.
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

__all__ = [
    "LoraConfig",
    "StepResult",
    "Trainer",
    "TrainerActor",
    "TrainerConfig",
    "TrainerGroup",
    "TrainerRankDied",
    "memory_line",
    "open_trainer",
    "trainer_mesh",
]
