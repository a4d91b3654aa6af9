"""Purpose-built parts for the gateway tests.

``tiny_tokenizer_dir`` saves a byte-level BPE trained here (``actors.tiny``) with a
Qwen-style ChatML template that supports tools: nothing is downloaded.
``ReplaySampler`` is a real actor with the sampler's ``generate``/``end_session``
endpoints whose policy is a script: it answers the n-th request with the n-th
scripted reply's ids, records every request, and gives each token a support row
(the token plus two neighbours, proper log q) and its version. A fake, not a mock.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from actors.sampler import GenerateRequest, GenerateResult
from orchestrator.runtime import Actor, endpoint

CORPUS = [
    "What is 2+3? The answer is 5. Let me use the calculator tool.",
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    "You are a helpful assistant. hello world, numbers 0123456789, guess higher lower",
    "<tool_response>\n5\n</tool_response> user assistant system tools functions",
]


def tiny_tokenizer_dir(out: Path) -> Path:
    from actors.tiny import train_tokenizer

    tok = train_tokenizer(CORPUS, vocab_size=400)
    tok.save_pretrained(out)
    return out


class ReplaySampler(Actor):
    def __init__(self, replies: list[list[int]], vocab_size: int, version: int = 7, pool: str = "replay") -> None:
        self.replies, self.vocab, self.version, self.pool = replies, vocab_size, version, pool
        self.seen: list[list[int]] = []
        self.sessions_ended: list[str] = []

    @endpoint
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        ids = self.replies[len(self.seen) % len(self.replies)][: req.max_new_tokens]
        self.seen.append(list(req.prompt_ids))
        sup, logq, offsets = [], [], [0]
        for t in ids:
            row = [t, (t + 1) % self.vocab, (t + 2) % self.vocab]
            sup += row
            logq += [math.log(0.5), math.log(0.3), math.log(0.2)]
            offsets.append(len(sup))
        stop = bool(ids) and ids[-1] in req.stop_token_ids
        return GenerateResult(
            request_id=req.request_id,
            token_ids=ids,
            support_ids=torch.tensor(sup, dtype=torch.int32),
            support_offsets=torch.tensor(offsets, dtype=torch.int32),
            support_logq=torch.tensor(logq, dtype=torch.float32),
            versions=[self.version] * len(ids),
            finish_reason="stop" if stop else "length",
            pool=self.pool,
            prompt_tokens=len(req.prompt_ids),
            seconds=0.0,
        )

    @endpoint
    def end_session(self, session_id: str) -> bool:
        self.sessions_ended.append(session_id)
        return True

    @endpoint
    def requests(self) -> list[list[int]]:
        return self.seen
