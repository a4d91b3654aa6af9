"""A small word-level tokenizer built locally, and chat turns built as token ids.

Why word-level and tiny: the built-in tasks (``guess_number``, ``arithmetic``) are
learnt by a tiny random-init model on CPU, so every integer the tasks use is ONE
token and the vocabulary stays under 128 entries. Nothing is downloaded: the
vocabulary is this file's word list, the tokenizer is built with ``tokenizers``
(WordLevel model, whitespace pre-tokenizer) and wrapped as a ``transformers``
``PreTrainedTokenizerFast`` so it plugs into anything that takes an HF tokenizer.

Chat layout (``ChatTokens``)::

    <bos> <|user|> text <|end|> <|assistant|> reply... <|end|> <|user|> obs <|end|> <|assistant|> ...

A conversation is built by *appending* ids: earlier turns are never re-tokenised,
so the ids the trainer sees are exactly the ids the sampler was conditioned on.

Importing this module does not import ``transformers``; building the tokenizer does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "MAX_INT",
    "SPECIAL_TOKENS",
    "TASK_WORDS",
    "UNK_TOKEN",
    "VOCAB",
    "VOCAB_SIZE",
    "WORD_CHAT_TEMPLATE",
    "ChatTokens",
    "build_tokenizer",
    "default_chat_tokens",
]

PAD, BOS, EOS, USER, ASSISTANT, END = ("<pad>", "<bos>", "<eos>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, USER, ASSISTANT, END)
UNK_TOKEN = "<unk>"
MAX_INT = 63
"""Integers 0..MAX_INT are single tokens; larger ones are <unk>."""

TASK_WORDS: tuple[str, ...] = (
    # guess_number
    "guess",
    "the",
    "number",
    "from",
    "to",
    "in",
    "turns",
    "turn",
    "higher",
    "lower",
    "correct",
    "invalid",
    "wrong",
    "left",
    # arithmetic
    "what",
    "is",
    "+",
    "-",
    "=",
    "?",
    "mod",
    # reverse
    "reverse",
    # generic
    ".",
    ",",
    "yes",
    "no",
    "answer",
    "a",
    "and",
    "you",
    "have",
    # sort (after the rest: the ids of earlier words stay as they were)
    "sort",
)
"""Words the built-in tasks use; kept short so the vocabulary stays < 128."""

VOCAB: tuple[str, ...] = SPECIAL_TOKENS + (UNK_TOKEN,) + tuple(str(i) for i in range(MAX_INT + 1)) + TASK_WORDS
"""The default vocabulary in id order: specials, <unk>, integers 0..63, words."""
VOCAB_SIZE = len(VOCAB)
"""Number of tokens in the default vocabulary (the model rounds it up to a multiple of 8)."""
assert len(set(VOCAB)) == VOCAB_SIZE < 128


WORD_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'user' %} <|user|> {{ m.content }} <|end|> <|assistant|>"
    "{% elif m.role == 'assistant' %} {{ m.content }} <|end|>{% endif %}{% endfor %}"
)
"""The ``ChatTokens`` layout as a Jinja chat template (for exported models): a user turn
hands over to the assistant itself, so no generation prompt is added. Whitespace is
free: the pre-tokenizer splits on it."""


def _check_extra(extra_words: Sequence[str]) -> None:
    seen = set(VOCAB)
    for i, w in enumerate(extra_words):
        if not w or any(c.isspace() for c in w):
            raise ValueError(f"extra_words[{i}] = {w!r}: a word must be non-empty without whitespace")
        if w in seen:
            raise ValueError(f"extra_words[{i}] = {w!r} is already in the vocabulary")
        seen.add(w)


def build_tokenizer(extra_words: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """Build the word-level tokenizer locally; ``extra_words`` are appended in order.

    Raises ValueError naming the word when an extra word contains whitespace or
    duplicates a word already in the vocabulary (the id layout must be unambiguous).
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    _check_extra(extra_words)
    words = list(VOCAB) + list(extra_words)
    core = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token=UNK_TOKEN))
    core.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[USER, ASSISTANT, END],
    )
    tok.chat_template = WORD_CHAT_TEMPLATE
    return tok


class ChatTokens:
    """Chat turns as token ids over a word-level tokenizer.

    Every method returns fresh ``list[int]`` to append to the running sequence;
    nothing here re-tokenises earlier turns. Encoding and decoding use the word
    table directly (WhitespaceSplit + WordLevel is a dictionary lookup), so the
    ``transformers`` wrapper is only built when ``.tokenizer`` is first read.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast | None = None, extra_words: Sequence[str] = ()) -> None:
        if tokenizer is not None and extra_words:
            raise ValueError("pass either a tokenizer or extra_words, not both")
        self._hf = tokenizer
        self._extra = tuple(extra_words)
        if tokenizer is not None:
            vocab = tokenizer.get_vocab()
        else:
            _check_extra(self._extra)
            vocab = {w: i for i, w in enumerate(VOCAB + self._extra)}
        missing = [t for t in SPECIAL_TOKENS + (UNK_TOKEN,) if t not in vocab]
        if missing:
            raise ValueError(f"tokenizer lacks the chat special tokens {missing}")
        self._vocab = vocab
        self._words = {i: w for w, i in vocab.items()}
        self.pad_id, self.bos_id, self.eos_id = vocab[PAD], vocab[BOS], vocab[EOS]
        self.user_id, self.assistant_id, self.end_id = vocab[USER], vocab[ASSISTANT], vocab[END]
        self.unk_id = vocab[UNK_TOKEN]
        self.special_ids = frozenset(vocab[t] for t in SPECIAL_TOKENS)

    @property
    def tokenizer(self) -> PreTrainedTokenizerFast:
        """The ``transformers`` tokenizer with the same vocabulary (built on first use)."""
        if self._hf is None:
            self._hf = build_tokenizer(self._extra)
        return self._hf

    @property
    def vocab_size(self) -> int:
        """Number of token ids (max id + 1)."""
        return len(self._vocab)

    @property
    def stop_ids(self) -> list[int]:
        """Ids that end an assistant turn when generated."""
        return [self.end_id, self.eos_id]

    def encode(self, text: str, *, strict: bool = False) -> list[int]:
        """Ids of ``text`` split on whitespace, no specials added.

        With ``strict`` an out-of-vocabulary word raises ValueError naming it and its
        position (the built-in tasks use this so a typo cannot silently become <unk>).
        """
        words = text.split()
        ids = [self._vocab.get(w, self.unk_id) for w in words]
        if strict:
            for pos, (w, i) in enumerate(zip(words, ids, strict=True)):
                if i == self.unk_id and w != UNK_TOKEN:
                    raise ValueError(f"word {pos} {w!r} of {text!r} is not in the vocabulary")
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Space-joined words of ``ids``; specials dropped unless ``skip_special`` is False.

        Ids outside the vocabulary decode as ``<unk>``.
        """
        out = []
        for i in ids:
            if skip_special and int(i) in self.special_ids:
                continue
            # ids past the vocabulary exist: the model's embedding is padded to a multiple
            # of 8 and an untrained sampler may emit those rows
            out.append(self._words.get(int(i), UNK_TOKEN))
        return " ".join(out)

    def int_id(self, n: int) -> int:
        """The single token id of the integer ``n`` (0..MAX_INT)."""
        if not 0 <= n <= MAX_INT:
            raise ValueError(f"integer {n} has no single token (0..{MAX_INT})")
        return self._vocab[str(n)]

    def _content(self, content: str | Sequence[int]) -> list[int]:
        if isinstance(content, str):
            return self.encode(content)
        ids = [int(i) for i in content]
        for pos, i in enumerate(ids):
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"observation token {i} at position {pos} is outside the vocabulary (size {self.vocab_size})"
                )
        return ids

    def user_turn(self, content: str | Sequence[int]) -> list[int]:
        """``<|user|> content <|end|> <|assistant|>``: a user turn that hands over to the assistant.

        ``content`` is text (tokenised) or token ids (used as they are).
        """
        return [self.user_id, *self._content(content), self.end_id, self.assistant_id]

    def prompt(self, content: str | Sequence[int]) -> list[int]:
        """The first turn of a conversation: ``<bos>`` then :meth:`user_turn`."""
        return [self.bos_id, *self.user_turn(content)]

    def close_assistant(self, generated: Sequence[int]) -> list[int]:
        """Ids to append after an assistant reply so the turn ends with ``<|end|>``.

        Empty when the sampler already stopped on a stop token (that token is part of
        the reply and is trained on); ``[<|end|>]`` when the reply ran out of length.
        """
        if generated and int(generated[-1]) in self.stop_ids:
            return []
        return [self.end_id]


@functools.cache
def default_chat_tokens() -> ChatTokens:
    """The process-wide ChatTokens over the default vocabulary (built once)."""
    return ChatTokens()
