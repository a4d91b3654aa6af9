"""What the gateway needs from a chat format beyond ``actors.chat.ChatFormat``.

``ChatFormat.render_new`` extends a conversation the session itself built (its
assistant turns are ids the sampler generated).  A harness can also send a history
with assistant turns the session never generated: the first request of a session
that replays a saved conversation, or a rewritten history.  Those start a new
segment whose context is the whole history rendered at once, which needs the
template's full rendering (``HFChatFormat.render``); the word format renders such a
history turn by turn.  Kept here, beside the gateway, rather than widening the
shared protocol for one user.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from actors.chat import ChatFormat, Conversation, HFChatFormat, WordChatFormat

__all__ = ["conversation_from"]


def conversation_from(fmt: ChatFormat, messages: Sequence[dict[str, Any]],
                      tools: Sequence[dict[str, Any]] | None) -> Conversation:
    """A ``Conversation`` holding ``messages`` as context, ending with the generation prompt.

    Histories without assistant turns go through ``Conversation.add`` (the append-only
    path). Otherwise the whole history is rendered once (HF template) or turn by turn
    (word format: an assistant turn's text is encoded and closed as a reply). Raises
    ValueError naming the turn for a history the format cannot render.
    """
    conv = Conversation(fmt, tools)
    if not any(m.get("role") == "assistant" for m in messages):
        conv.add(list(messages))
        return conv
    if messages[-1].get("role") == "assistant":
        raise ValueError(f"messages[{len(messages) - 1}]: the last message is an assistant turn; "
                         "there is nothing to answer")
    if isinstance(fmt, HFChatFormat):
        conv.ids = fmt.encode(fmt.render(messages, generation_prompt=True, tools=tools))
        conv.messages = [dict(m) for m in messages]
        return conv
    if isinstance(fmt, WordChatFormat):
        pending: list[dict[str, Any]] = []
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
    raise ValueError(f"{type(fmt).__name__} cannot render a history with assistant turns it did not "
                     "generate")
