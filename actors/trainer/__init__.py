"""The trainer: fp32 master weights, AdamW, the recipe loss, weight publishing, checkpoints.

``TrainerActor`` is what the controller drives (``train_step``, ``updates_for``,
``ack``, ``version``, ``keyframe``, ``save_checkpoint``); ``Trainer`` is the same
training logic as a plain in-process object.
"""
from actors.trainer._actor import TrainerActor
from actors.trainer._config import StepResult, TrainerConfig
from actors.trainer._core import Trainer

__all__ = ["StepResult", "Trainer", "TrainerActor", "TrainerConfig"]
