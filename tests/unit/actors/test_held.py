"""The held-trajectory store and the packed batch a holder answers a fetch with."""

from __future__ import annotations

import pytest
import torch

from actors.held import HeldBatch, TrajectoryStore
from actors.types import TENSOR_FIELDS, Trajectory


def _traj(n: int, i: int, *, failed: bool = False) -> Trajectory:
    return Trajectory(
        task="t",
        prompt_id=f"p{i}",
        group_id=f"g{i // 2}",
        pool="a",
        tokens=torch.arange(n + 2),
        loss_mask=torch.tensor([0, 0] + [1] * n, dtype=torch.bool),
        support_ids=torch.arange(2 * n, dtype=torch.int32),
        support_offsets=torch.arange(0, 2 * n + 1, 2, dtype=torch.int32),
        support_logq=-torch.rand(2 * n),
        versions=torch.full((n,), i, dtype=torch.int32),
        reward=float(i % 2),
        failed=failed,
        error="boom" if failed else None,
        turns=1,
        seconds=0.5,
    )


def test_a_packed_batch_unpacks_to_the_same_trajectories_in_order():
    trajs = [_traj(3, 0), None, _traj(5, 2), _traj(1, 3)]
    batch = HeldBatch.pack(trajs)
    assert batch.tensors[0].numel() == (3 + 2) + (5 + 2) + (1 + 2)
    out = batch.unpack()
    assert out[1] is None
    for a, b in zip(trajs, out, strict=True):
        if a is None:
            continue
        assert b.model_dump(exclude=set(TENSOR_FIELDS)) == a.model_dump(exclude=set(TENSOR_FIELDS))
        for k in TENSOR_FIELDS:
            assert torch.equal(getattr(a, k), getattr(b, k)), k
    assert HeldBatch.pack([None, None]).unpack() == [None, None]


def test_a_batch_whose_parts_do_not_fit_is_refused_by_name():
    batch = HeldBatch.pack([_traj(3, 0), _traj(2, 1)])
    short = batch.model_copy(update={"tensors": [batch.tensors[0][:-1], *batch.tensors[1:]]})
    with pytest.raises(ValueError, match="tokens holds 8 values, its lengths sum to 9"):
        short.unpack()
    with pytest.raises(ValueError, match="meta rows"):
        batch.model_copy(update={"meta": batch.meta[:1]}).unpack()
    # A trajectory whose own layout is broken fails its validation, naming the field.
    swapped = batch.model_copy(update={"tensors": [batch.tensors[0], *batch.tensors[1:5], batch.tensors[5][:0]]})
    with pytest.raises(ValueError):
        swapped.unpack()


def _broken(**fields: torch.Tensor) -> Trajectory:
    """A trajectory of 3 generated tokens with some tensors replaced, not validated."""
    t = _traj(3, 1)
    return Trajectory.model_construct(
        **{**t.model_dump(exclude=set(TENSOR_FIELDS)), **{k: getattr(t, k) for k in TENSOR_FIELDS}, **fields}
    )


_i32 = torch.int32
BROKEN = {
    "mask shorter than tokens": dict(loss_mask=torch.tensor([0, 0, 1, 1], dtype=torch.bool)),
    "one offset too many": dict(support_offsets=torch.tensor([0, 2, 4, 6, 6], dtype=_i32)),
    "one version too few": dict(versions=torch.ones(2, dtype=_i32)),
    "logq shorter than ids": dict(support_logq=-torch.rand(5)),
    "offsets start past 0": dict(support_offsets=torch.tensor([1, 2, 4, 6], dtype=_i32)),
    "offsets end short of the ids": dict(support_offsets=torch.tensor([0, 2, 4, 5], dtype=_i32)),
    "offsets fall": dict(support_offsets=torch.tensor([0, 4, 2, 6], dtype=_i32)),
    "versions of another dtype": dict(versions=torch.ones(3, dtype=torch.int64)),
}


@pytest.mark.parametrize("fault", sorted(BROKEN))
def test_a_batch_checks_each_trajectorys_layout_as_its_own_validation_would(fault):
    # The batch is checked whole (`check_layouts`), not trajectory by trajectory: each
    # fault the trajectory's own validation refuses is refused here, naming the trajectory.
    broken = _broken(**BROKEN[fault])
    with pytest.raises(ValueError):
        Trajectory.model_validate(broken.model_dump())
    batch = HeldBatch.pack([_traj(2, 0), None, broken, _traj(4, 3)])
    with pytest.raises(ValueError, match="trajectory 1 of the batch|versions must have dtype"):
        batch.unpack()


def test_the_store_holds_until_released_and_evicts_the_oldest_past_its_bound():
    store = TrajectoryStore(max_held=2)
    failed = store.put(_traj(1, 9, failed=True))
    assert failed.key == "" and len(store) == 0  # a failed episode is not held
    refs = [store.put(_traj(2, i)) for i in range(3)]
    assert len({r.key for r in refs}) == 3 and refs[0].nbytes > 0
    assert refs[1].num_generated == 2 and refs[1].oldest_version == refs[1].newest_version == 1
    assert store.evicted == 1 and store.get([r.key for r in refs])[0] is None  # the oldest went
    assert store.release([refs[1].key, "nope"]) == 1
    assert store.stats() == {"held": 1, "held_bytes": refs[2].nbytes, "held_evicted": 1, "held_fetched": 2}
    assert TrajectoryStore().put(_traj(1, 0)).key != refs[0].key  # keys of another store never repeat
