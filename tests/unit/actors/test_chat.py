"""ChatFormat: turns rendered append-only with a real chat template and a locally trained
byte-level BPE tokenizer; tool calls; a template that rewrites history fails naming the turn."""

from __future__ import annotations

import pytest

from actors.chat import (
    ChatFormat,
    ChatTemplateError,
    Conversation,
    HFChatFormat,
    WordChatFormat,
    load_chat_format,
)
from actors.tiny import train_tokenizer
from actors.tokenizer import default_chat_tokens
from actors.toolcalls import parse_tool_calls

CORPUS = [
    "hello world, what is two plus two? the answer is four.",
    "call get_weather with city Paris; it is sunny and warm today.",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
] * 4
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

# Qwen3-style: earlier assistant turns lose their <think> block when re-rendered.
DROPS_THINKING = """\
{%- for m in messages %}
{%- if m.role == 'assistant' and not loop.last %}
{{- '<|im_start|>assistant\\n' + (m.content.split('</think>')[-1] | trim) + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("tok")
    train_tokenizer(CORPUS, vocab_size=320).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def fmt(tok_dir) -> HFChatFormat:
    return HFChatFormat.from_dir(tok_dir)


def _reply(fmt: HFChatFormat, text: str, stop: bool = True) -> list[int]:
    return fmt.encode(text) + ([fmt.stop_ids[0]] if stop else [])


def test_load_chat_format_picks_the_directory_tokenizer(tok_dir, tmp_path) -> None:
    assert isinstance(load_chat_format(tok_dir), HFChatFormat)
    assert isinstance(load_chat_format(tmp_path), WordChatFormat)  # no tokenizer files
    assert isinstance(load_chat_format(None), WordChatFormat)
    for f in (HFChatFormat.from_dir(tok_dir), WordChatFormat()):
        assert isinstance(f, ChatFormat)


def test_multi_turn_ids_are_append_only_and_match_the_template(fmt: HFChatFormat) -> None:
    convo = Conversation(fmt)
    first = convo.add([{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two plus two?"}])
    assert fmt.decode(first, skip_special=False).endswith("<|im_start|>assistant\n")
    held = list(convo.ids)
    for turn, (reply, obs) in enumerate([("four", "and three plus two?"), ("the answer is five", "thanks")]):
        convo.add_reply(_reply(fmt, reply))
        new = convo.add(obs)
        assert convo.ids[: len(held)] == held, f"turn {turn}: earlier ids changed"
        held = list(convo.ids)
        # The only text between the generated stop token and the next user turn is the
        # template's "\n": nothing generated was re-tokenised or dropped.
        assert fmt.decode(new, skip_special=False).startswith("\n<|im_start|>user\n" + obs)
    # With BPE splits that agree, the held ids decode to the template's full rendering.
    assert fmt.decode(convo.ids, skip_special=False) == fmt.render(convo.messages, generation_prompt=True)
    assert [m["role"] for m in convo.messages] == ["system", "user", "assistant", "user", "assistant", "user"]


def test_generated_ids_are_kept_even_when_text_would_split_differently(fmt: HFChatFormat) -> None:
    convo = Conversation(fmt)
    convo.add("hello")
    # "world" spelled one character per token: the same text re-tokenises to fewer ids.
    odd = [i for ch in "world" for i in fmt.encode(ch)] + [fmt.stop_ids[0]]
    assert len(odd) > len(_reply(fmt, "world"))
    convo.add_reply(odd)
    start = len(convo.ids) - len(odd)
    convo.add("again")
    assert convo.ids[start : start + len(odd)] == odd


def test_reply_cut_by_length_is_closed_by_the_template(fmt: HFChatFormat) -> None:
    convo = Conversation(fmt)
    convo.add("hello")
    convo.add_reply(_reply(fmt, "the answer", stop=False))
    new = convo.add("go on")
    assert fmt.decode(new, skip_special=False).startswith("<|im_end|>\n<|im_start|>user\ngo on")


def test_tool_call_turns(fmt: HFChatFormat) -> None:
    convo = Conversation(fmt, tools=TOOLS)
    first = fmt.decode(convo.add("weather in Paris?"), skip_special=False)
    assert '"name": "get_weather"' in first and "<tools>" in first
    # The model writes compact JSON; the template would re-render it with spaces. The held
    # ids stay as generated and the turn is spliced at the stop token.
    msg = convo.add_reply(_reply(fmt, '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'))
    assert msg["tool_calls"] == [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    held = list(convo.ids)
    new = convo.add({"role": "tool", "name": "get_weather", "content": "sunny"})
    assert convo.ids == held + new
    assert fmt.decode(new, skip_special=False) == (
        "\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    convo.add_reply(_reply(fmt, "it is sunny"))
    assert convo.messages[-1] == {"role": "assistant", "content": "it is sunny"}


def test_template_that_rewrites_history_names_the_turn(tok_dir) -> None:
    tok = train_tokenizer(CORPUS, vocab_size=320, chat_template=DROPS_THINKING)
    fmt = HFChatFormat(tok)
    convo = Conversation(fmt)
    convo.add("hello")
    convo.add_reply(_reply(fmt, "<think>hmm</think>four"))
    with pytest.raises(ChatTemplateError, match=r"turn 2 \(user\).*not prefix-preserving"):
        convo.add("and again?")
    # without a thinking block the same template extends append-only
    ok = Conversation(fmt)
    ok.add("hello")
    ok.add_reply(_reply(fmt, "four"))
    assert fmt.decode(ok.add("and again?"), skip_special=False).startswith("\n<|im_start|>user")


def test_assistant_messages_only_come_from_replies(fmt: HFChatFormat) -> None:
    with pytest.raises(ValueError, match="turn 1: assistant turns are added with add_reply"):
        Conversation(fmt).add([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])


def test_parse_tool_calls_styles() -> None:
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', "hermes")[1][0][
        "function"
    ] == {"name": "f", "arguments": {"x": 1}}
    assert parse_tool_calls("<tool_call>not json</tool_call>", "hermes") == ("<tool_call>not json</tool_call>", [])
    content, calls = parse_tool_calls('ok [TOOL_CALLS][{"name": "g", "arguments": {}}]', "mistral")
    assert content == "ok" and calls[0]["function"]["name"] == "g"
    assert parse_tool_calls('{"name": "h", "parameters": {"a": "b"}}', "llama3")[1][0]["function"] == {
        "name": "h",
        "arguments": {"a": "b"},
    }
    assert parse_tool_calls("plain words", "llama3") == ("plain words", [])


def test_word_format_keeps_the_builtin_layout() -> None:
    chat = default_chat_tokens()
    convo = Conversation(WordChatFormat())
    assert convo.add("what is 2 + 3 ?") == chat.prompt("what is 2 + 3 ?")
    convo.add_reply([chat.int_id(4)])  # cut by length: closed with <|end|>
    assert convo.add("wrong") == [chat.end_id, *chat.user_turn("wrong")]
    convo.add_reply([chat.int_id(5), chat.end_id])
    assert convo.add({"role": "user", "content": [chat.int_id(9)]}) == chat.user_turn([chat.int_id(9)])
    with pytest.raises(ValueError, match="turn 6: .* got role 'tool'"):
        convo.add_reply([chat.end_id])
        convo.add({"role": "tool", "content": "x"})
    with pytest.raises(ValueError, match="no tool-call format"):
        Conversation(WordChatFormat(), tools=TOOLS).add("hi")
