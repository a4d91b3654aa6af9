"""The controller's keyframe stream over the runtime: a real trainer actor slices its stored
keyframe into parts, the controller's `send_path` moves them one at a time through the mesh
links, and a real sampler decodes them into its own snapshot -- generating exactly what a
sampler given the whole keyframe generates. A corrupted part is refused with a clear error
and the sampler goes on with the weights it had."""

from __future__ import annotations

import pytest
import trio

from actors.models import default_model_config
from actors.sampler import GenerateRequest, SamplerActor
from actors.tokenizer import VOCAB_SIZE
from actors.trainer import TrainerActor, TrainerConfig
from hardware import PoolConfig
from orchestrator.controller._stream import send_path
from orchestrator.controller.meshes import MeshPool, MeshTrainer
from orchestrator.runtime import ActorError, open_mesh

ENV = {"OMP_NUM_THREADS": "1"}


async def _tokens(sampler, rid: str) -> tuple[list[int], list[float]]:  # tokens and log q of their supports
    res = await sampler.generate.call_one(
        GenerateRequest(request_id=rid, prompt_ids=[1, 2, 3, 4], max_new_tokens=6, seed=11)
    )
    return res.token_ids, res.support_logq.tolist()


@pytest.mark.slow  # three actor processes, ~15 s on 2 loaded cores
async def test_keyframe_streamed_in_parts_through_the_runtime() -> None:
    model = default_model_config(VOCAB_SIZE)
    with trio.fail_after(90):
        async with (
            open_mesh(TrainerActor, TrainerConfig(model=model), procs=1, name="trainer", env=ENV) as tmesh,
            open_mesh(
                SamplerActor, "cpu-bf16", "bf16", model, init_seed=None, procs=2, name="sampler", env=ENV
            ) as smesh,
        ):
            trainer = MeshTrainer(tmesh)
            pool = MeshPool(PoolConfig(name="cpu-bf16", gpu="B200", device="cpu"), smesh)
            whole = await tmesh[0].keyframe.call_one("bf16")
            part_bytes = sum(len(f) for f in whole) // 5
            path = await trainer.update_path("s0", -1, "bf16", part_bytes)
            assert path["deltas"] == [] and path["keyframe"]["version"] == 0
            assert path["keyframe"]["parts"] >= 4
            assert await smesh[0].version.call_one() == -1
            now, wire = await send_path(trainer, pool, 0, "bf16", path, part_bytes)
            assert now == 0 and wire == path["keyframe"]["wire_bytes"] - len(whole[0])
            assert await pool.apply_weights(1, [whole]) == 0  # the same keyframe in one message
            streamed = await _tokens(smesh[0], "a")
            assert streamed == await _tokens(smesh[1], "b")  # bit-identical weights: same tokens

            # A corrupted part: refused by name, the sampler keeps generating with what it had.
            await pool.reset_weights(0)  # as after a trainer restore: it takes keyframe 0 again
            kf = path["keyframe"]
            first = await trainer.keyframe_part("bf16", kf["version"], 0, part_bytes)
            header, frames = await trainer.keyframe_part("bf16", kf["version"], 1, part_bytes)
            bad = bytearray(frames[0])
            bad[len(bad) // 2 :] = bytes(len(bad) - len(bad) // 2)
            assert await pool.apply_weights_part(0, *first) == 0
            with pytest.raises(ActorError) as err:
                await pool.apply_weights_part(0, header, [bytes(bad), *frames[1:]])
            assert err.value.remote_type.rsplit(".", 1)[-1] in ("CorruptPayloadError", "HashMismatchError")
            assert "tensor" in err.value.message and "chunk" in err.value.message
            assert await smesh[0].version.call_one() == 0
            assert await smesh[0].have_version.call_one() is None  # the next update must be a keyframe
            assert await _tokens(smesh[0], "c") == streamed
            with pytest.raises(ActorError, match="no stream started"):
                await pool.apply_weights_part(0, *await trainer.keyframe_part("bf16", 0, 2, part_bytes))
            with pytest.raises(ActorError, match="VersionError"):  # a keyframe the trainer no longer has
                await trainer.keyframe_part("bf16", 5, 0, part_bytes)

            # The controller's next attempt streams it again and all is well.
            path = await trainer.update_path("s0", -1, "bf16", part_bytes)
            assert (await send_path(trainer, pool, 0, "bf16", path, part_bytes))[0] == 0
            assert await smesh[0].have_version.call_one() == 0
            assert await _tokens(smesh[0], "d") == streamed
