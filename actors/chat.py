"""Chat turns as token ids, append-only: the ``ChatFormat`` every episode, gateway and export uses.

A conversation is a list of messages (OpenAI/HF shape: ``{"role", "content"}``,
assistant ``tool_calls``, ``tool`` results) and, beside it, the token ids the
sampler was conditioned on.  The ids are only ever appended to: the ids of
earlier turns are never re-derived from text, because byte-identical text can
tokenise to a different BPE split and templates may rewrite history.

``Conversation`` is the running state; a ``ChatFormat`` knows how to turn new
messages into the ids to append:

* ``HFChatFormat`` -- a Hugging Face tokenizer with a chat template.  New turns'
  ids come from the template rendered *with* the new messages minus the template
  rendered *without* them; the prefix property (the longer rendering starts with
  the shorter one) is checked every time, and a template that breaks it raises
  ``ChatTemplateError`` naming the turn.  A generated assistant turn is held as
  the ids the sampler generated, whatever they decode to (invalid UTF-8, a
  character split at the length limit, the template's own special tokens): the
  template is only asked for the text *around* a reply, by rendering the turn with
  a marker as its content, and what follows the marker closes the turn (e.g. Qwen's
  ``"\\n"`` after a generated ``<|im_end|>``, or all of ``"<|im_end|>\\n"`` after a
  reply cut at ``max_tokens``).  The reply's text is never searched for in a
  rendering, so a tool-call JSON that the template would re-format never changes
  the ids already held.
* ``WordChatFormat`` -- the built-in word tokenizer (``actors.tokenizer``) of the
  CPU demo: ``<bos> <|user|> text <|end|> <|assistant|> reply <|end|> ...``.

Tool calls: ``tools=[...]`` (OpenAI function schemas) are handed to the template;
generated text is parsed into ``{"content", "tool_calls"}`` by the family's
convention (``actors.toolcalls.parse_tool_calls``): Qwen/Hermes ``<tool_call>{json}</tool_call>``,
Mistral ``[TOOL_CALLS][{json}, ...]``, Llama 3 a bare ``{"name", "parameters"}``
JSON reply.

Importing this module does not import ``transformers`` or torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from actors.tokenizer import ChatTokens, default_chat_tokens
from actors.toolcalls import parse_tool_calls, tool_style

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "ChatFormat",
    "ChatTemplateError",
    "Conversation",
    "HFChatFormat",
    "Message",
    "WordChatFormat",
    "load_chat_format",
]

Message = dict[str, Any]
"""One chat message: ``{"role": "system"|"user"|"assistant"|"tool", "content": ...}``, an
assistant message may carry ``tool_calls`` (``[{"type": "function", "function": {"name",
"arguments"}}]``), a tool message ``tool_call_id``/``name``."""


class ChatTemplateError(ValueError):
    """A chat template cannot extend the conversation append-only (names the turn)."""


@runtime_checkable
class ChatFormat(Protocol):
    """Renders chat turns into token ids to append; see the module docstring."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (the model may have more rows)."""
        ...

    @property
    def stop_ids(self) -> list[int]:
        """Ids that end an assistant turn when generated."""
        ...

    def encode(self, text: str) -> list[int]:
        """Ids of plain ``text`` (no special tokens added)."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of ``ids``; special tokens dropped unless ``skip_special`` is False."""
        ...

    def render_new(
        self,
        history: Sequence[Message],
        new: Sequence[Message],
        *,
        generated: Sequence[int] | None,
        tools: Sequence[dict] | None,
        turn: int,
    ) -> list[int]:
        """Ids to append so that ``history + new`` ends with the assistant's generation prompt.

        ``generated`` is the ids of the last assistant reply when ``history`` ends with
        it (they are already held; only what closes the turn is returned for it).
        ``turn`` (0-based index of the first new message) is named in errors.
        """
        ...

    def parse_reply(self, generated: Sequence[int]) -> Message:
        """The assistant message of a generated reply (content and parsed tool calls)."""
        ...


class Conversation:
    """Messages and the ids that render them, grown append-only.

    ``add(messages)`` appends non-assistant turns (system, user, tool) and returns the
    ids it appended, ending with the assistant generation prompt; ``add_reply(ids)``
    records a generated assistant reply (its ids are appended as they are) and returns
    the parsed message.  ``ids`` is always exactly what the sampler was conditioned on
    plus what it generated.
    """

    def __init__(self, fmt: ChatFormat, tools: Sequence[dict] | None = None) -> None:
        self.fmt = fmt
        self.tools = list(tools) if tools else None
        self.messages: list[Message] = []
        self.ids: list[int] = []
        self._generated: list[int] | None = None  # ids of the reply that ends `messages`

    def add(self, messages: Message | Sequence[Message] | str) -> list[int]:
        """Append user/system/tool turns; return the new ids (ending with the generation prompt).

        A string is one user message.  Raises ChatTemplateError naming the turn when
        the template cannot extend the rendering append-only, ValueError for an
        assistant message (replies come from ``add_reply``).
        """
        new = _as_messages(messages)
        for i, m in enumerate(new):
            if m.get("role") == "assistant":
                raise ValueError(
                    f"turn {len(self.messages) + i}: assistant turns are added with "
                    "add_reply (their ids come from the sampler)"
                )
        ids = self.fmt.render_new(
            self.messages, new, generated=self._generated, tools=self.tools, turn=len(self.messages)
        )
        self.messages += new
        self.ids += ids
        self._generated = None
        return ids

    def add_reply(self, generated: Sequence[int]) -> Message:
        """Record the assistant reply ``generated`` (ids appended unchanged); its message."""
        gen = [int(i) for i in generated]
        msg = self.fmt.parse_reply(gen)
        self.messages.append(msg)
        self.ids += gen
        self._generated = gen
        return msg

    @classmethod
    def from_messages(
        cls, fmt: ChatFormat, messages: Sequence[Message], tools: Sequence[dict] | None = None
    ) -> Conversation:
        """A conversation holding ``messages`` as context, ending with the generation prompt.

        For a history the running conversation cannot be extended to (a template that
        rewrites earlier turns, or a history a harness sent): its ids are the format's
        rendering of all of it, not ids a sampler generated.  Histories without
        assistant turns go through ``add`` (the append-only path); otherwise the HF
        template renders the whole history at once, the word format turn by turn (an
        assistant turn's text encoded and closed as a reply).  Raises ValueError naming
        the turn for a history the format cannot render.
        """
        conv = cls(fmt, tools)
        if not any(m.get("role") == "assistant" for m in messages):
            conv.add(list(messages))
            return conv
        if messages[-1].get("role") == "assistant":
            raise ValueError(
                f"messages[{len(messages) - 1}]: the last message is an assistant turn; there is nothing to answer"
            )
        if isinstance(fmt, HFChatFormat):
            conv.ids = fmt.encode(fmt.render(messages, generation_prompt=True, tools=tools))
            conv.messages = [dict(m) for m in messages]
            return conv
        if isinstance(fmt, WordChatFormat):
            pending: list[Message] = []
            for i, m in enumerate(messages):
                if m.get("role") != "assistant":
                    pending.append(m)
                    continue
                if not pending:
                    raise ValueError(f"messages[{i}]: two assistant turns in a row")
                conv.add(pending)
                pending = []
                conv.add_reply(fmt.encode(str(m.get("content") or "")))
            conv.add(pending)
            return conv
        raise ValueError(f"{type(fmt).__name__} cannot render a history with assistant turns it did not generate")


def _as_messages(messages: Message | Sequence[Message] | str) -> list[Message]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    if isinstance(messages, dict):
        return [dict(messages)]
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"message {i} must be a dict with a 'role', got {m!r}")
        out.append(dict(m))
    return out


# ---------------------------------------------------------------------------- HF tokenizer


class HFChatFormat:
    """A Hugging Face tokenizer and its chat template (see the module docstring).

    Args:
        tokenizer: a loaded ``transformers`` tokenizer with a ``chat_template``.
        template_kwargs: extra variables for the template (e.g. ``enable_thinking``).

    Raises ValueError when the tokenizer has no chat template.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template_kwargs: dict[str, Any] | None = None) -> None:
        template = tokenizer.chat_template
        if not template:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat_template")
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.tool_style = tool_style(template if isinstance(template, str) else json.dumps(template))
        specials = set(tokenizer.all_special_ids)
        self._special_ids = frozenset(specials)
        stops = []
        for tok in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|eom_id|>"):
            tid = tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
                stops.append(tid)
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stops:
            stops.append(tokenizer.eos_token_id)
        if not stops:
            raise ValueError(
                f"tokenizer {tokenizer.name_or_path!r} has no eos token (an assistant turn could never end)"
            )
        self._stop_ids = stops

    @classmethod
    def from_dir(cls, path: str | Path, **kwargs: Any) -> HFChatFormat:
        """Load the tokenizer of a local checkpoint directory (nothing is downloaded)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True), **kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def stop_ids(self) -> list[int]:
        return list(self._stop_ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self.tokenizer.decode(
            [int(i) for i in ids], skip_special_tokens=skip_special, clean_up_tokenization_spaces=False
        )

    def render(
        self, messages: Sequence[Message], *, generation_prompt: bool, tools: Sequence[dict] | None = None
    ) -> str:
        """The template's text for ``messages`` (with the assistant generation prompt or not)."""
        out = self.tokenizer.apply_chat_template(
            [_text_content(m, self) for m in messages],
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **self.template_kwargs,
        )
        if not isinstance(out, str):
            raise TypeError(f"apply_chat_template returned {type(out).__name__}, expected str")
        return out

    def render_new(
        self,
        history: Sequence[Message],
        new: Sequence[Message],
        *,
        generated: Sequence[int] | None,
        tools: Sequence[dict] | None,
        turn: int,
    ) -> list[int]:
        if not new:
            raise ValueError(f"turn {turn}: no new messages to add")
        after = self.render([*history, *new], generation_prompt=True, tools=tools)
        if not history:
            # The first turns: the whole rendering (the template writes BOS itself).
            return self.encode(after)
        before = self.render(history, generation_prompt=False, tools=tools)
        closing = self._closing(history, before, generated, tools, turn - 1) if generated is not None else ""
        if not after.startswith(before):
            at = _diverge(before, after)
            raise ChatTemplateError(
                f"turn {turn} ({new[0].get('role')}): the chat template is not prefix-preserving "
                f"(rendering with the new turn rewrites earlier text at character {at}: "
                f"{before[at:][:40]!r} became {after[at:][:40]!r})"
            )
        return self.encode(closing + after[len(before) :])

    def _closing(
        self,
        history: Sequence[Message],
        with_reply: str,
        generated: Sequence[int],
        tools: Sequence[dict] | None,
        turn: int,
    ) -> str:
        """The template's text that closes the reply held as ``generated`` (the last message
        of ``history``, whose rendering is ``with_reply``).

        The reply's ids are never looked for in text: the template renders the turn with
        a marker as its only content (no tool calls: their text is in the generated ids),
        and what follows the marker is the turn's closing.  When the ids end with a stop
        id whose text the closing holds, the closing starts after it; otherwise (cut at
        the length limit, or a stop the template does not close turns with) all of it
        follows the held ids.
        """
        prompt = self.render(history[:-1], generation_prompt=True, tools=tools)
        marked = self.render(
            [*history[:-1], {"role": "assistant", "content": _MARK}], generation_prompt=False, tools=tools
        )
        for rendering in (marked, with_reply):
            if not rendering.startswith(prompt):
                at = _diverge(prompt, rendering)
                raise ChatTemplateError(
                    f"turn {turn} (assistant): the chat template is not prefix-preserving (the "
                    f"text before the reply changes once the reply is rendered, at character {at}: "
                    f"{prompt[at:][:40]!r} became {rendering[at:][:40]!r})"
                )
        if marked.count(_MARK) != 1:
            raise ChatTemplateError(
                f"turn {turn} (assistant): the chat template does not render an assistant "
                "message's content once, as it is (the end of the reply cannot be placed)"
            )
        closing = marked[marked.index(_MARK) + len(_MARK) :]
        if generated and int(generated[-1]) in self._stop_ids:
            stop_text = self.decode([int(generated[-1])], skip_special=False)
            at = closing.find(stop_text) if stop_text else -1
            if at >= 0:
                return closing[at + len(stop_text) :]
        return closing

    def parse_reply(self, generated: Sequence[int]) -> Message:
        gen = [int(i) for i in generated]
        if gen and gen[-1] in self._stop_ids:
            gen = gen[:-1]
        text = self.decode(gen, skip_special=False)
        # Specials other than the tool markers are not content (e.g. a stray <|endoftext|>).
        for tid in self._special_ids:
            tok = self.tokenizer.convert_ids_to_tokens(tid)
            if tok and tok not in ("[TOOL_CALLS]", "<|python_tag|>", "<tool_call>", "</tool_call>"):
                text = text.replace(tok, "")
        content, calls = parse_tool_calls(text, self.tool_style)
        msg: Message = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        return msg


_MARK = "FLOTILLAREPLYMARK7f3c9e1b5a"
"""Content of the assistant turn rendered to find the text that closes a turn: plain
ASCII letters, which no template trims, escapes or splits."""


def _text_content(m: Message, fmt: HFChatFormat) -> Message:
    # Token-id content (an environment's observation as ids) goes through the template as
    # its text: a chat template renders strings only.
    content = m.get("content")
    if isinstance(content, list) and all(isinstance(i, int) for i in content):
        return {**m, "content": fmt.decode(content, skip_special=False)}
    return m


def _diverge(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


# ---------------------------------------------------------------------------- word tokenizer


class WordChatFormat:
    """The built-in word tokenizer's chat layout as a ``ChatFormat`` (the CPU demo's).

    ``<bos> <|user|> text <|end|> <|assistant|> reply... <|end|> <|user|> ...``.  Only
    ``user`` turns exist in this layout (a ``system`` message is refused, a ``tool``
    message too: the word vocabulary has no markers for them).  A user message whose
    ``content`` is a list of ints is used as ids as they are.
    """

    def __init__(self, chat: ChatTokens | None = None) -> None:
        self.chat = chat if chat is not None else default_chat_tokens()

    @property
    def vocab_size(self) -> int:
        return self.chat.vocab_size

    @property
    def stop_ids(self) -> list[int]:
        return self.chat.stop_ids

    def encode(self, text: str) -> list[int]:
        return self.chat.encode(text)

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self.chat.decode(ids, skip_special=skip_special)

    def render_new(
        self,
        history: Sequence[Message],
        new: Sequence[Message],
        *,
        generated: Sequence[int] | None,
        tools: Sequence[dict] | None,
        turn: int,
    ) -> list[int]:
        if tools:
            raise ValueError(
                "the built-in word tokenizer has no tool-call format; use a model directory with a chat template"
            )
        ids: list[int] = [] if history else [self.chat.bos_id]
        if generated is not None:
            ids += self.chat.close_assistant(generated)
        for i, m in enumerate(new):
            if m.get("role") != "user":
                raise ValueError(
                    f"turn {turn + i}: the built-in word tokenizer has only user and "
                    f"assistant turns, got role {m.get('role')!r}"
                )
            content = m.get("content", "")
            ids += self.chat.user_turn(content if isinstance(content, (str, list)) else str(content))
        return ids

    def parse_reply(self, generated: Sequence[int]) -> Message:
        return {"role": "assistant", "content": self.chat.decode(generated)}


def load_chat_format(model_path: str | Path | None, template_kwargs: dict[str, Any] | None = None) -> ChatFormat:
    """The chat format of a run: the checkpoint's tokenizer when ``model_path`` holds one,
    else the built-in word tokenizer. ``template_kwargs`` go to the chat template (e.g.
    ``{"enable_thinking": False}`` for Qwen3).

    A directory counts as holding a tokenizer when it has ``tokenizer.json`` or
    ``tokenizer_config.json``; such a tokenizer without a chat template raises ValueError.
    """
    if model_path is not None:
        d = Path(model_path)
        if (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file():
            return HFChatFormat.from_dir(d, template_kwargs=template_kwargs)
    return WordChatFormat()
