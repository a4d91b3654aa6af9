"""`SharedPaths`: one trainer call per (precision, held version, trainer version), shared by
every rank asking meanwhile; a failed or cancelled call makes each waiter ask again.
`PendingAcks`: the newest version per receiver, handed over in one batch."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from orchestrator.controller._stream import PendingAcks, SharedPaths
from orchestrator.runtime import ActorDied


class Trainer:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str]] = []
        self.fail_next = 0
        self.gate = trio.Event()

    async def update_path(self, receiver: str, have: int, precision: str, part_bytes: int) -> dict[str, Any]:
        self.calls.append((receiver, have, precision))
        await self.gate.wait()
        if self.fail_next:
            self.fail_next -= 1
            raise ActorDied("trainer", 0, "killed")
        return {"keyframe": None, "deltas": [[f"{precision}:{have}:{len(self.calls)}".encode()]]}


async def _ask_all(paths: SharedPaths, asks: list[tuple[str, int, str]], version: int, out: dict) -> None:
    async def one(receiver: str, have: int, precision: str) -> None:
        try:
            out[receiver] = await paths.get(receiver, have, precision, version)
        except ActorDied as e:
            out[receiver] = e

    async with trio.open_nursery() as n:
        for a in asks:
            n.start_soon(one, *a)


async def test_ranks_asking_the_same_path_share_one_call() -> None:
    trainer = Trainer()
    paths = SharedPaths(trainer)  # type: ignore[arg-type]
    out: dict[str, Any] = {}
    asks = [(f"p/{r}", 3, "bf16") for r in range(8)] + [("p/8", -1, "bf16"), ("q/0", 3, "fp8")]
    async with trio.open_nursery() as n:
        n.start_soon(_ask_all, paths, asks, 4, out)
        await trio.testing.wait_all_tasks_blocked()
        trainer.gate.set()
    # one call per (held version, precision), by whichever rank asked first
    assert sorted((have, precision) for _, have, precision in trainer.calls) == [(-1, "bf16"), (3, "bf16"), (3, "fp8")]
    assert len({id(out[f"p/{r}"]) for r in range(8)}) == 1  # one answer, shared
    assert out["p/8"] is not out["p/0"] and out["q/0"] is not out["p/0"]
    # the same question later, same trainer version: answered from the shared path
    assert await paths.get("p/9", 3, "bf16", 4) is out["p/0"]
    assert len(trainer.calls) == 3
    # a newer trainer version asks again (and lets the older answers go)
    await paths.get("p/0", 3, "bf16", 5)
    assert len(trainer.calls) == 4
    paths.clear()  # the trainer went back to a checkpoint
    await paths.get("p/0", 3, "bf16", 5)
    assert len(trainer.calls) == 5


async def test_a_failed_call_makes_each_waiter_ask_again() -> None:
    trainer = Trainer()
    trainer.fail_next = 1
    paths = SharedPaths(trainer)  # type: ignore[arg-type]
    out: dict[str, Any] = {}
    async with trio.open_nursery() as n:
        n.start_soon(_ask_all, paths, [(f"p/{r}", 0, "bf16") for r in range(4)], 1, out)
        await trio.testing.wait_all_tasks_blocked()
        trainer.gate.set()
    failed = [r for r, v in out.items() if isinstance(v, ActorDied)]
    assert len(failed) == 1  # the asker whose call failed sees it
    answers = {id(v) for v in out.values() if not isinstance(v, ActorDied)}
    assert len(answers) == 1 and len(trainer.calls) == 2  # the others shared one new call


async def test_a_cancelled_asker_does_not_strand_the_others() -> None:
    trainer = Trainer()
    paths = SharedPaths(trainer)  # type: ignore[arg-type]
    out: dict[str, Any] = {}
    first = trio.CancelScope()

    async def asker() -> None:
        with first:
            await paths.get("p/0", 0, "bf16", 1)

    async with trio.open_nursery() as n:
        n.start_soon(asker)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(_ask_all, paths, [("p/1", 0, "bf16"), ("p/2", 0, "bf16")], 1, out)
        await trio.testing.wait_all_tasks_blocked()
        first.cancel()  # e.g. its sampler stopped answering
        await trio.testing.wait_all_tasks_blocked()
        trainer.gate.set()
    assert out["p/1"] is out["p/2"] and len(trainer.calls) == 2


async def test_pending_acks_keep_the_newest_per_receiver_and_hand_over_all() -> None:
    acks = PendingAcks()
    acks.add("bf16", "p/0", 3)
    acks.add("bf16", "p/0", 4)
    acks.add("bf16", "p/1", 4)
    acks.add("fp8", "q/0", 2)
    assert await acks.take() == {"bf16": {"p/0": 4, "p/1": 4}, "fp8": {"q/0": 2}}
    acks.add("bf16", "p/0", 5)
    acks.clear()  # the trainer went back to a checkpoint
    with trio.move_on_after(0.05) as waited:
        await acks.take()
    assert waited.cancelled_caught  # nothing pending: take waits
    acks.add("bf16", "p/2", 6)
    assert await acks.take() == {"bf16": {"p/2": 6}}
