"""The training step in-process: packing, micro-batch invariance, metrics, errors, checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from actors.trainer import Trainer, TrainerConfig
from actors.trainer._packing import pack
from actors.types import Trajectory
from orchestrator.state.checkpoints import CheckpointError
from policies import RecipeConfig
from tests.unit.actors.trainer_batches import on_policy_batch

torch.set_num_threads(1)
PLAIN = RecipeConfig(importance="none", score_centering=False)


@pytest.fixture(scope="module")
def batch() -> list[Trajectory]:
    return on_policy_batch(prompts=3, group=4, new_tokens=3)


def test_pack_budget_and_prediction_positions(batch: list[Trajectory]) -> None:
    mbs = pack(batch, micro_batch_tokens=40, pad_id=0)
    assert sorted(i for mb in mbs for i in mb.members) == list(range(len(batch)))
    for mb in mbs:
        b, width = mb.input_ids.shape
        assert b * width <= 40 or b == 1
        for r, i in enumerate(mb.members):
            n = batch[i].tokens.numel()
            assert mb.attention_mask[r].sum() == n and bool((mb.input_ids[r, n:] == 0).all())
        # the state at column c predicts the token at c + 1
        assert torch.equal(mb.input_ids[mb.rows, mb.cols + 1], mb.targets)
    one = pack(batch, micro_batch_tokens=1, pad_id=0)
    assert len(one) == len(batch)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        pack(batch, 0, 0)


def test_micro_batching_does_not_change_the_step(batch: list[Trajectory]) -> None:
    big = Trainer(TrainerConfig(micro_batch_tokens=100_000))
    small = Trainer(TrainerConfig(micro_batch_tokens=1))
    rb, rs = big.train_step(batch), small.train_step(batch)
    assert rb.micro_batches == 1 and rs.micro_batches == len(batch)
    assert rb.loss == pytest.approx(rs.loss, abs=1e-7)
    assert rb.grad_norm == pytest.approx(rs.grad_norm, rel=1e-5)
    for name, w in big.master_weights().items():
        # Adam divides by sqrt(v): rounding-level gradient differences stay far below lr
        # (1e-3), though an element whose gradient is itself at rounding level can move by
        # a few percent of it
        torch.testing.assert_close(w, small.master_weights()[name], rtol=0, atol=5e-5)


def test_step_metrics_on_policy(batch: list[Trajectory]) -> None:
    tr = Trainer(TrainerConfig())
    r = tr.train_step(batch)
    assert r.applied and r.version == tr.version == 1
    assert r.tokens == 36 and r.trajectories == 12 and r.failed_skipped == 0
    assert r.grad_norm > 0 and r.seconds > 0
    # the batch was sampled from these very weights: sampler and trainer agree
    assert r.overall.mismatch_kl == pytest.approx(0.0, abs=1e-6)
    assert r.overall.mean_weight == pytest.approx(1.0, abs=1e-4)
    assert r.overall.masked_fraction == 0.0 and r.overall.entropy > 0
    assert set(r.per_pool) == {"a", "b"}
    assert sum(m.tokens for m in r.per_pool.values()) == r.tokens
    assert r.reward_mean == pytest.approx(sum(t.reward for t in batch) / len(batch))


def test_one_step_lowers_the_policy_gradient_surrogate(batch: list[Trajectory]) -> None:
    """On-policy, the recipe's gradient equals that of S(θ) = −Σ A·log p^S_θ(y) / N (w = 1,
    the centering term's gradient is zero), a fixed function of θ on this batch: one
    small step must lower it, for the full recipe and for plain REINFORCE."""
    assert len({t.reward for t in batch}) == 2  # mixed rewards: nonzero advantages
    for recipe in (RecipeConfig(), PLAIN):
        tr = Trainer(TrainerConfig(lr=1e-4, recipe=recipe))
        before = tr.evaluate(batch, PLAIN).loss
        own = tr.evaluate(batch).loss
        r = tr.train_step(batch)
        assert r.loss == pytest.approx(own, abs=1e-7)  # reported at the pre-step weights
        after = tr.evaluate(batch, PLAIN).loss
        assert after < before - 1e-3, (recipe, before, after)


def test_failed_and_uniform_groups(batch: list[Trajectory]) -> None:
    tr = Trainer(TrainerConfig())
    bad = batch[0].model_copy(update={"failed": True, "error": "boom", "reward": 0.0})
    r = tr.train_step([bad, *batch[1:]])
    assert r.failed_skipped == 1 and r.trajectories == len(batch) - 1
    # all rewards equal: every advantage is 0, so is the loss and the gradient
    same = [t.model_copy(update={"reward": 1.0}) for t in batch]
    r0 = Trainer(TrainerConfig()).train_step(same)
    assert r0.loss == 0.0 and r0.grad_norm == 0.0
    with pytest.raises(ValueError, match="none of the 1"):
        tr.train_step([bad])


def test_malformed_support_names_the_trajectory(batch: list[Trajectory]) -> None:
    t = batch[0]
    first = int(t.support_offsets[1])
    ids = t.support_ids.clone()
    y = int(t.tokens[t.loss_mask][0])
    ids[:first] = torch.where(ids[:first] == y, (y + 1) % 100, ids[:first])  # y out of its row
    broken = t.model_copy(update={"support_ids": ids, "prompt_id": "broken-one"})
    with pytest.raises(ValueError, match="broken-one"):
        Trainer(TrainerConfig()).train_step([broken, *batch[1:]])


def test_no_replay_ablation_runs(batch: list[Trajectory]) -> None:
    cfg = TrainerConfig(recipe=RecipeConfig(mask_replay=False, score_centering=False))
    r = Trainer(cfg).train_step(batch)
    assert r.applied and r.overall.entropy is None and r.grad_norm > 0


def test_checkpoint_in_process_is_bit_exact(batch: list[Trajectory], tmp_path: Path) -> None:
    cfg = TrainerConfig(weight_decay=0.01)
    a = Trainer(cfg)
    a.train_step(batch[:6])
    path = a.save_checkpoint(str(tmp_path / "ck"))
    digest = a.digest()
    ra = a.train_step(batch[6:])
    b = Trainer(cfg, resume_from=path)
    assert b.version == 1 and b.digest() == digest
    rb = b.train_step(batch[6:])
    assert (rb.loss, rb.grad_norm, rb.version) == (ra.loss, ra.grad_norm, ra.version)
    assert b.digest() == a.digest()
    # the layout: a loadable model dir, flattened Adam state, scalars in JSON
    opt = load_file(str(tmp_path / "ck" / "optimizer.safetensors"))
    name = "model.embed_tokens.weight"
    assert {f"exp_avg/{name}", f"exp_avg_sq/{name}", f"step/{name}", "rng/torch_cpu"} <= set(opt)
    assert opt["rng/torch_cpu"].dtype == torch.uint8
    meta = json.loads((tmp_path / "ck" / "trainer.json").read_text())
    assert meta["version"] == 1 and meta["config"]["weight_decay"] == 0.01
    with pytest.raises(CheckpointError, match=r"nope: cannot be loaded: FileNotFoundError: .*trainer\.json"):
        Trainer(cfg, resume_from=str(tmp_path / "nope"))


def test_token_outside_vocabulary_names_the_trajectory(batch: list[Trajectory]) -> None:
    t = batch[0]
    tokens = t.tokens.clone()
    tokens[0] = 10_000
    bad = t.model_copy(update={"tokens": tokens, "prompt_id": "too-big"})
    with pytest.raises(ValueError, match="too-big.*10000"):
        Trainer(TrainerConfig()).train_step([bad])


def test_entropy_on_stuck_groups_alone(batch: list[Trajectory]) -> None:
    """entropy_groups = "stuck": the term reaches the stuck group's tokens only (g0 all 0,
    below g2 all 1); with no stuck group the loss is the one without the term."""
    reward = {"g0": 0.0, "g2": 1.0}
    stuck = [t.model_copy(update={"reward": reward.get(t.group_id, t.reward)}) for t in batch]
    assert len({t.reward for t in stuck if t.group_id == "g1"}) == 2  # g1 keeps a spread
    tr = Trainer(TrainerConfig())
    beta = 0.5
    none = tr.evaluate(stuck, RecipeConfig()).loss
    every = tr.evaluate(stuck, RecipeConfig(entropy_coef=beta)).loss
    only = tr.evaluate(stuck, RecipeConfig(entropy_coef=beta, entropy_groups="stuck")).loss
    assert every < only < none  # a bonus lowers the loss; on a third of the tokens, less
    unstuck = [t.model_copy(update={"reward": 1.0 if t.group_id == "g0" else t.reward}) for t in stuck]
    cfg = RecipeConfig(entropy_coef=beta, entropy_groups="stuck")
    assert tr.evaluate(unstuck, cfg).loss == tr.evaluate(unstuck, RecipeConfig()).loss
