"""Supervised fine-tuning on the trainer: tokenization and masking, the loss, bad records."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from actors.chat import WordChatFormat
from actors.models import build_model
from actors.tokenizer import default_chat_tokens
from actors.trainer import SftDataError, Trainer, TrainerConfig, tokenize_records


def _write(path: Path, records: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _sums(n: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(5), rng.randrange(5)
        out.append({"prompt": f"what is {a} + {b} ?", "completion": str(a + b)})
    return out


def test_records_render_like_episodes_with_loss_on_replies_only(tmp_path: Path) -> None:
    chat = default_chat_tokens()
    path = _write(
        tmp_path / "d.jsonl",
        [
            {"prompt": "what is 1 + 2 ?", "completion": "3"},
            {
                "messages": [
                    {"role": "user", "content": "guess the number from 0 to 6 in 3 turns"},
                    {"role": "assistant", "content": "3"},
                    {"role": "user", "content": "higher"},
                    {"role": "assistant", "content": "5"},
                ]
            },
        ],
    )
    pair, chat_seq = tokenize_records(path, WordChatFormat(), 256)
    # the ids an episode would hold: prompt, the reply, and its <|end|>
    want = chat.prompt("what is 1 + 2 ?") + [chat.int_id(3), chat.end_id]
    assert pair.tokens.tolist() == want
    assert pair.loss_mask.tolist() == [False] * (len(want) - 2) + [True, True]
    assert chat_seq.source.endswith("d.jsonl:2")
    ids, mask = chat_seq.tokens.tolist(), chat_seq.loss_mask.tolist()
    learnt = [chat.decode([i], skip_special=False) for i, m in zip(ids, mask, strict=True) if m]
    assert learnt == ["3", "<|end|>", "5", "<|end|>"]
    assert chat.decode(ids) == "guess the number from 0 to 6 in 3 turns 3 higher 5"


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "expected an object"),
        ('{"prompt": "what is 1 + 2 ?"}', "'completion' must be a string"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
        ('{"messages": [{"role": "system", "content": "x"}, {"role": "assistant", "content": "3"}]}', "role 'system'"),
        ('{"prompt": "what is 1 + 2 ?", "completion": ""}', "has no tokens"),
        ('{"prompt": "a", "completion": "3", "extra": 1}', "unknown field 'extra'"),
        ('{"text": "x"}', "expected 'messages' or 'prompt'"),
    ],
)
def test_a_bad_record_is_one_line_naming_its_line(tmp_path: Path, line: str, problem: str) -> None:
    path = _write(tmp_path / "bad.jsonl", [*_sums(2), "", line])  # a blank line still counts
    with pytest.raises(SftDataError) as info:
        tokenize_records(path, WordChatFormat(), 256)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"{path}:4: ") and problem in msg, msg


def test_too_long_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(SftDataError, match=r":1: \d+ tokens, more than model.max_seq_len = 8"):
        tokenize_records(_write(tmp_path / "a.jsonl", _sums(1)), WordChatFormat(), 8)
    with pytest.raises(SftDataError, match="no records"):
        tokenize_records(_write(tmp_path / "b.jsonl", [""]), WordChatFormat(), 8)


def _completion_logprob(model: torch.nn.Module, seqs: list) -> float:
    """Sum of log p(reply token | prefix) over every reply token, by a plain forward pass:
    a reference computed apart from the trainer's loss."""
    total = 0.0
    with torch.no_grad():
        for s in seqs:
            logits = model(input_ids=s.tokens[None]).logits[0].float()
            logp = torch.log_softmax(logits[:-1], -1)
            pos = torch.nonzero(s.loss_mask).flatten()
            total += float(logp[pos - 1, s.tokens[pos]].sum())
    return total


def test_sft_lowers_the_loss_and_raises_the_completions_likelihood(tmp_path: Path) -> None:
    data = tokenize_records(_write(tmp_path / "d.jsonl", _sums(96)), WordChatFormat(), 256)
    trainer = Trainer(TrainerConfig(micro_batch_tokens=256))
    before = trainer.sft_evaluate(data)
    ref = build_model(trainer.model_config, seed=0)
    assert _completion_logprob(ref, data) == pytest.approx(-before.loss * before.tokens, rel=1e-4)
    for k in range(24):
        res = trainer.sft_step(data[(k * 32) % 96 : (k * 32) % 96 + 32], 3e-3)
        assert res.applied and res.version == k + 1 and res.tokens == 64
    after = trainer.sft_evaluate(data)
    assert after.loss < 0.6 * before.loss, (before.loss, after.loss)
    # the saved checkpoint's model, loaded like a run's [model] path, assigns the
    # completions the likelihood the trainer reports
    trainer.save_checkpoint(str(tmp_path / "ck"))
    loaded = build_model(str(tmp_path / "ck" / "model"))
    lp = _completion_logprob(loaded, data)
    assert lp == pytest.approx(-after.loss * after.tokens, rel=1e-4)
    assert lp > _completion_logprob(ref, data) + 0.4 * before.loss * before.tokens


def test_micro_batching_does_not_change_the_loss(tmp_path: Path) -> None:
    data = tokenize_records(_write(tmp_path / "d.jsonl", _sums(12)), WordChatFormat(), 256)
    small, big = Trainer(TrainerConfig(micro_batch_tokens=16)), Trainer(TrainerConfig(micro_batch_tokens=4096))
    a, b = small.sft_step(data, 1e-3), big.sft_step(data, 1e-3)
    assert a.loss == pytest.approx(b.loss, rel=1e-5) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
    # Adam's first step moves each weight by about lr * g / (|g| + eps): where a gradient
    # element is near eps, float sums in another order move it by a visible fraction of lr
    # (2.9e-6 on one CPU). A wrong micro-batch weighting moves weights by whole lr-sized steps.
    for (n, p), (_, q) in zip(small.params.items(), big.params.items(), strict=True):
        assert torch.allclose(p, q, atol=1e-5), n


def test_a_chat_template_model_learns_only_its_assistant_turns(tmp_path: Path) -> None:
    from actors.chat import HFChatFormat, load_chat_format
    from actors.tiny import make_checkpoint, train_tokenizer

    texts = ["what is one plus two", "three", "and two plus two", "four", "you are terse"]
    model_dir = make_checkpoint(tmp_path / "m", "qwen2", tokenizer=train_tokenizer(texts, vocab_size=300), seed=0)
    fmt = load_chat_format(model_dir)
    assert isinstance(fmt, HFChatFormat)
    path = _write(
        tmp_path / "d.jsonl",
        [
            {
                "messages": [
                    {"role": "system", "content": "you are terse"},
                    {"role": "user", "content": "what is one plus two"},
                    {"role": "assistant", "content": "three"},
                    {"role": "user", "content": "and two plus two"},
                    {"role": "assistant", "content": "four"},
                ]
            }
        ],
    )
    (seq,) = tokenize_records(path, fmt, 512)
    ids, mask = seq.tokens.tolist(), seq.loss_mask.tolist()
    learnt = [i for i, m in zip(ids, mask, strict=True) if m]
    stop = fmt.stop_ids[0]
    # each reply's tokens and its stop token; nothing of the system or user turns
    assert learnt == fmt.encode("three") + [stop] + fmt.encode("four") + [stop]
    text = fmt.decode(ids, skip_special=False)
    assert "you are terse" in text and text.index("three") < text.index("and two plus two") < text.index("four")
    trainer = Trainer(TrainerConfig(model=str(model_dir)))
    before = trainer.sft_evaluate([seq]).loss
    for _ in range(10):
        trainer.sft_step([seq], 1e-2)
    assert trainer.sft_evaluate([seq]).loss < 0.5 * before
