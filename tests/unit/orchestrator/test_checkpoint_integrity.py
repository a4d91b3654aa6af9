"""No damaged checkpoint is loaded: digests in the marker, verification at save and resume,
fallback to an older checkpoint that verifies, and one-line errors from the loaders.

The checkpoints are real: a tiny trainer writes its safetensors files through the same
replacement sequence a run uses; the damage is what fault injection did to such files
(64 bytes XORed in the middle, 0xFF bytes which read as NaN, a broken header).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import trio
from safetensors.torch import load_file, save_file

from actors.trainer import Trainer, TrainerConfig
from orchestrator.state.checkpoints import (
    CheckpointError,
    commit_checkpoint_dir,
    file_digest,
    latest_checkpoint,
    save_checkpoint_dir,
    stage_checkpoint_dir,
    verify_checkpoint,
)
from orchestrator.state.progress import Progress
from tests.unit.actors.trainer_batches import on_policy_batch

torch.set_num_threads(1)
MODEL, OPT = "model/model.safetensors", "optimizer.safetensors"


def _write_generation(trainer: Trainer, run_dir: Path, step: int) -> None:
    async def write(staging: Path) -> None:
        trainer.save_checkpoint(str(staging))
        (staging / "controller_state.json").write_text(json.dumps({"step": step}))

    trio.run(lambda: save_checkpoint_dir(run_dir, write, meta={"step": step}))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory with one real trainer checkpoint (after one optimizer step)."""
    run_dir = tmp_path_factory.mktemp("pristine")
    trainer = Trainer(TrainerConfig())
    trainer.train_step(on_policy_batch(prompts=2, group=2, new_tokens=3))
    _write_generation(trainer, run_dir, 1)
    return run_dir


@pytest.fixture
def run_dir(pristine: Path, tmp_path: Path) -> Path:
    shutil.copytree(pristine, tmp_path / "run")
    return tmp_path / "run"


def _xor_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + 64):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def _nan_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))


def _bad_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[10:20] = b"\x00" * 10
    path.write_bytes(bytes(data))


DAMAGE = {
    "xor in the model": (MODEL, _xor_middle),
    "NaN in the model": (MODEL, _nan_middle),
    "NaN in the optimizer": (OPT, _nan_middle),
    "bad model header": (MODEL, _bad_header),
    "bad optimizer header": (OPT, _bad_header),
}


def _marker(ckpt: Path) -> dict:
    return json.loads((ckpt / "COMPLETE").read_text())


def _set_marker(ckpt: Path, **changes: object) -> None:
    m = _marker(ckpt)
    for k, v in changes.items():
        if v is None:
            m.pop(k, None)
        else:
            m[k] = v
    (ckpt / "COMPLETE").write_text(json.dumps(m))


def _one_line(text: str) -> str:
    assert "\n" not in text and "Traceback" not in text, text
    return text


def test_the_marker_records_a_digest_of_every_file(pristine: Path) -> None:
    ckpt = pristine / "checkpoint"
    m = _marker(ckpt)
    files = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != "COMPLETE")
    assert m["digest"] == "xxh3-128" and sorted(m["digests"]) == sorted(m["files"]) == files
    assert {MODEL, OPT, "trainer.json", "controller_state.json"} <= set(files)
    for rel, want in m["digests"].items():
        assert file_digest(ckpt / rel) == want and len(want) == 32
    assert verify_checkpoint(ckpt) is None


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_refused_in_one_line_naming_the_file(case: str, run_dir: Path) -> None:
    rel, damage = DAMAGE[case]
    size = (run_dir / "checkpoint" / rel).stat().st_size
    damage(run_dir / "checkpoint" / rel)
    assert (run_dir / "checkpoint" / rel).stat().st_size == size  # sizes alone cannot tell
    with pytest.raises(CheckpointError) as e:
        latest_checkpoint(run_dir, warn=pytest.fail)
    msg = _one_line(str(e.value))
    assert f"checkpoint/{rel}: xxh3-128 digest" in msg and "does not match" in msg
    assert "no other checkpoint" in msg
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint"]  # nothing deleted or moved


@pytest.mark.parametrize("case", sorted(set(DAMAGE) - {"xor in the model"}))
def test_an_old_checkpoint_without_digests_is_still_checked_by_the_loader(case: str, run_dir: Path) -> None:
    """Markers of the previous version list sizes only: such a checkpoint loads, with one
    warning, and the loader itself refuses non-finite values and unreadable headers."""
    ckpt = run_dir / "checkpoint"
    _set_marker(ckpt, digests=None, digest=None)
    said: list[str] = []
    assert latest_checkpoint(run_dir, warn=said.append) == ckpt
    assert len(said) == 1 and "without file digests" in said[0] and "sizes only" in said[0]
    Trainer(TrainerConfig(), resume_from=str(ckpt))  # undamaged: loads
    rel, damage = DAMAGE[case]
    damage(ckpt / rel)
    with pytest.raises(CheckpointError) as e:
        Trainer(TrainerConfig(), resume_from=str(ckpt))
    msg = _one_line(str(e.value))
    assert msg.startswith(f"{ckpt / rel}: "), msg
    expected = (
        "non-finite value" if "NaN" in case else "cannot be read: SafetensorError: Error while deserializing header"
    )
    assert expected in msg and len(msg) < 400, msg


def test_wrong_shapes_are_one_line_naming_the_file_and_tensor(run_dir: Path) -> None:
    ckpt = run_dir / "checkpoint"
    weights = load_file(str(ckpt / MODEL))
    name = "model.norm.weight"
    weights[name] = torch.ones(weights[name].shape[0] + 1)
    save_file(weights, str(ckpt / MODEL), metadata={"format": "pt"})
    # Re-seal the marker: the file verifies, only its content is wrong for the model.
    m = _marker(ckpt)
    m["files"][MODEL] = (ckpt / MODEL).stat().st_size
    m["digests"][MODEL] = file_digest(ckpt / MODEL)
    (ckpt / "COMPLETE").write_text(json.dumps(m))
    assert latest_checkpoint(run_dir, warn=pytest.fail) == ckpt
    with pytest.raises(CheckpointError) as e:
        Trainer(TrainerConfig(), resume_from=str(ckpt))
    msg = _one_line(str(e.value))
    assert f"{ckpt / MODEL}: tensor {name} has shape" in msg and "model expects" in msg


def test_a_damaged_newest_falls_back_to_the_good_older_one_and_keeps_it(run_dir: Path) -> None:
    ckpt = run_dir / "checkpoint"
    shutil.copytree(ckpt, run_dir / "checkpoint.old")  # the good, older one (step 1)
    _set_marker(ckpt, seq=_marker(ckpt)["seq"] + 1, meta={"step": 2})
    _xor_middle(ckpt / MODEL)
    good = (run_dir / "checkpoint.old" / MODEL).read_bytes()
    said: list[str] = []
    assert latest_checkpoint(run_dir, warn=said.append) == ckpt
    assert len(said) == 1, said
    line = _one_line(said[0])
    assert f"{ckpt / MODEL}: xxh3-128 digest" in line and "not loaded" in line
    assert "resuming from the older checkpoint (step 1)" in line and "checkpoint.corrupt" in line
    assert (ckpt / MODEL).read_bytes() == good and _marker(ckpt)["meta"] == {"step": 1}
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint", "checkpoint.corrupt"]
    assert verify_checkpoint(run_dir / "checkpoint.corrupt") is not None  # kept as it was found
    assert Trainer(TrainerConfig(), resume_from=str(ckpt)).version == 1
    # The next save replaces the good checkpoint only once the new one verified.
    trainer = Trainer(TrainerConfig(), resume_from=str(ckpt))
    _write_generation(trainer, run_dir, 2)
    assert verify_checkpoint(ckpt) is None and _marker(ckpt)["meta"] == {"step": 2}


def test_all_damaged_is_one_line_and_nothing_is_deleted(run_dir: Path) -> None:
    ckpt = run_dir / "checkpoint"
    shutil.copytree(ckpt, run_dir / "checkpoint.old")
    _set_marker(ckpt, seq=_marker(ckpt)["seq"] + 1)
    _xor_middle(ckpt / MODEL)
    _nan_middle(run_dir / "checkpoint.old" / OPT)
    with pytest.raises(CheckpointError) as e:
        latest_checkpoint(run_dir, warn=pytest.fail)
    msg = _one_line(str(e.value))
    assert f"{ckpt / MODEL}: xxh3-128 digest" in msg and "no other checkpoint" in msg  # the newest named
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint", "checkpoint.old"]


def test_a_file_that_reads_back_differently_stops_the_replacement_before_any_deletion(run_dir: Path) -> None:
    """Between the marker and the verify step the disk returns other bytes: the save fails in
    one line, the previous checkpoint stays, and resume skips the new one."""
    ckpt = run_dir / "checkpoint"
    before = (ckpt / MODEL).read_bytes()
    staging = stage_checkpoint_dir(ckpt)
    trainer = Trainer(TrainerConfig())
    trainer.save_checkpoint(str(staging))

    def on_step(name: str) -> None:
        if name == "marker":
            _xor_middle(staging / MODEL)

    with pytest.raises(CheckpointError, match=r"model\.safetensors: .*read back after writing; the previous"):
        commit_checkpoint_dir(ckpt, staging, {"step": 2}, on_step=on_step)
    assert (ckpt / MODEL).read_bytes() == before and verify_checkpoint(ckpt) is None
    said: list[str] = []
    assert latest_checkpoint(run_dir, warn=said.append) == ckpt
    assert len(said) == 1 and "checkpoint.new/model/model.safetensors" in said[0] and "older" in said[0]
    assert (ckpt / MODEL).read_bytes() == before


def test_hashing_streams_a_file_larger_than_its_chunk(tmp_path: Path, monkeypatch) -> None:
    import xxhash

    from orchestrator.state import checkpoints

    data = bytes(range(256)) * 5000
    (tmp_path / "f").write_bytes(data)
    monkeypatch.setattr(checkpoints, "_CHUNK", 4096)  # 313 reads
    assert file_digest(tmp_path / "f", uncached=True) == xxhash.xxh3_128(data).hexdigest()


def test_repeated_messages_are_rate_limited_with_a_count_and_bounded(capsys) -> None:
    progress = Progress(10)
    for i in range(1000):
        progress.repeated(("respawn", "pool", 0), f"sampler pool/0 died; respawning it ({i})")
        progress.failure("episode 3#1 failed (error): " + "x" * 100_000 + "\nTraceback tail")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines  # one per key within the interval; the rest are counted
    assert all(len(line) <= 400 for line in lines), [len(line) for line in lines]
    assert "... (" in lines[1] and "more)" in lines[1]
    progress.failure_every_s = 0.0
    progress.repeated(("respawn", "pool", 0), "sampler pool/0 died; respawning it")
    assert "(and 999 more like it since the last line)" in capsys.readouterr().err
