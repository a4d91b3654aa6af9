"""The trainer's learning-rate schedule is a function of the policy version."""

import pytest

from actors.trainer import Trainer, TrainerConfig


def test_linear_decay_follows_the_version_and_then_holds():
    trainer = Trainer(TrainerConfig(lr=1e-3, lr_decay_steps=4, lr_final_ratio=0.5))
    rates = []
    for version in range(7):
        trainer.version = version
        rates.append(trainer.learning_rate())
    assert rates == pytest.approx([1e-3, 0.875e-3, 0.75e-3, 0.625e-3, 0.5e-3, 0.5e-3, 0.5e-3])


def test_constant_without_decay():
    trainer = Trainer(TrainerConfig(lr=2e-3))
    trainer.version = 100
    assert trainer.learning_rate() == 2e-3
