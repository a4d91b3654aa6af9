"""The controller's own state: what a checkpoint keeps beside the trainer's weights.

One owner per piece: `ControllerState` holds the step and prompt counters, the
buffer's counters (the buffer mutates that same object), the prompts still buffered
at the last save, and the cost ledger's and scheduler's states. `save` writes it
atomically; `load` validates it with pydantic and names the file and field that is
wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from actors.types import TaskSpec
from orchestrator.state.buffer import BufferCounters
from orchestrator.state.checkpoints import write_file_atomic

__all__ = ["STATE_FILE", "ControllerState"]

STATE_FILE = "controller_state.json"


class ControllerState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step: int = Field(default=0, ge=0)
    """Training steps done."""
    version: int = Field(default=0, ge=0)
    """The trainer's policy version after the last step."""
    prompts: int = Field(default=0, ge=0)
    """Prompts issued so far (the next prompt's index)."""
    buffer: BufferCounters = Field(default_factory=BufferCounters)
    """The rollout buffer's counters."""
    buffered: list[TaskSpec] = Field(default_factory=list)
    """Prompts that were buffered (not yet trained) at the last save: a resumed run plays
    them first, so a stop loses none."""
    ledger: dict[str, Any] = Field(default_factory=dict)
    """CostLedger.state()."""
    scheduler: dict[str, Any] = Field(default_factory=dict)
    """Scheduler.state()."""
    trainer_restarts: int = Field(default=0, ge=0)
    """Times a dead trainer was restored from a checkpoint."""

    def save(self, directory: Path) -> Path:
        path = Path(directory) / STATE_FILE
        write_file_atomic(path, self.model_dump_json(indent=1).encode())
        return path

    @classmethod
    def load(cls, directory: Path) -> ControllerState:
        path = Path(directory) / STATE_FILE
        try:
            return cls.model_validate(json.loads(path.read_text()))
        except FileNotFoundError:
            raise ValueError(f"{path}: missing") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise ValueError(f"{path}: {where}: {first['msg']}") from None
