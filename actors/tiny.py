"""Tiny local Hugging Face checkpoints: a byte-level BPE tokenizer trained here, a chat
template, and a random-init model of one of the supported families.

Tests and ``examples/byo`` build real checkpoint directories with these (nothing is
downloaded): ``train_tokenizer`` trains a byte-level BPE with the ``tokenizers``
library on a few texts, ``make_checkpoint`` saves a model of a family (``qwen3``,
``qwen2``, ``llama``, ``mistral``) with ``save_pretrained`` beside the tokenizer.

torch and transformers are imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["CHATML_TEMPLATE", "FAMILIES", "family_config", "make_checkpoint", "train_tokenizer"]

CHATML_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou may call functions. Signatures in <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nReturn a call as <tool_call>\\n{"name": <name>, "arguments": <args>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' + (tool_call.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
"""A ChatML template in the shape of Qwen2.5's, with Hermes-style tool calls."""

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")

_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
}

FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "qwen2": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "mistral": {
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_window": None,
    },
}
"""Per-family config fields on top of the tiny shape (Llama 3 with its rope scaling)."""


def family_config(family: str, vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """A tiny config dict of ``family`` for a tokenizer of ``vocab_size`` tokens."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    vocab = -(-vocab_size // 8) * 8
    return {**_BASE, **FAMILIES[family], "vocab_size": vocab, **overrides}


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 400, chat_template: str = CHATML_TEMPLATE
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts`` here, with ChatML specials and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(list(texts), trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<tool_call>", "</tool_call>"],
    )
    tok.chat_template = chat_template
    return tok


def make_checkpoint(
    out: str | Path,
    family: str = "qwen3",
    *,
    texts: Iterable[str] = (),
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
    shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Save a tiny random-init ``family`` model with a locally trained tokenizer to ``out``.

    ``shard_size`` (e.g. ``"20KB"``) splits the safetensors into shards as large
    checkpoints are.  Returns the directory.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out)
    tok = (
        tokenizer
        if tokenizer is not None
        else train_tokenizer(list(texts) or ["hello world, this is a tiny corpus of words and 0123456789 digits."])
    )
    fields = family_config(family, len(tok), **overrides)
    fields["bos_token_id"] = None
    fields["eos_token_id"] = tok.eos_token_id
    fields["pad_token_id"] = tok.pad_token_id
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    kwargs: dict[str, Any] = {"max_shard_size": shard_size} if shard_size else {}
    model.to(torch.float32).save_pretrained(out, **kwargs)
    tok.save_pretrained(out)
    return out
