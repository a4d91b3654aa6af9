"""The controller's own state: what a checkpoint keeps beside the trainer's weights.

One owner per piece: `ControllerState` holds the step and prompt counters, the
buffer's counters (the buffer mutates that same object), the prompts still buffered
at the last save, and the cost ledger's and scheduler's states. `save` writes it
atomically; `load` validates it with pydantic and names the file and field that is
wrong.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from actors.types import TaskSpec
from orchestrator.buffer import BufferCounters

__all__ = ["STATE_FILE", "ControllerState", "write_atomic"]

STATE_FILE = "controller_state.json"


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` by `text` so that a crash leaves the old file or the new one, whole."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
        write_atomic(path, self.model_dump_json(indent=1))
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
