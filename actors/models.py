"""The policy model every Flotilla actor builds locally: a tiny Qwen3 or a user's checkpoint.

Trainer, samplers and tests must agree bit for bit on the initial weights, so
they all build the model here: from a config dict with a seeded random init,
or from a local Hugging Face checkpoint directory (``config.json`` +
``*.safetensors``, sharded or not).  The model is transformers' own class for
the config's ``model_type`` (``AutoModelForCausalLM``); the families the torch
sampler engine also runs are ``SUPPORTED_MODEL_TYPES``.  Nothing is ever
downloaded.

torch and transformers are imported inside the functions so that importing
``actors.models`` stays cheap (the CLI path must not import torch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "SUPPORTED_MODEL_TYPES",
    "build_model",
    "checkpoint_params",
    "default_model_config",
    "load_model_config",
    "model_weights",
    "read_tensors",
    "round_vocab",
]

DEFAULT_VOCAB_SIZE = 128
"""Vocabulary size used when the caller does not pass its tokenizer's size."""

SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "qwen3": "Qwen3",
    "qwen2": "Qwen2/Qwen2.5 (qkv bias)",
    "llama": "Llama 3 (llama3 rope scaling)",
    "mistral": "Mistral",
}
"""Dense decoder families (config ``model_type``) that Flotilla trains and samples."""


def round_vocab(size: int, multiple: int = 8) -> int:
    """Round a tokenizer's size up to a multiple of ``multiple`` (embedding rows)."""
    if size <= 0:
        raise ValueError(f"vocab_size must be positive, got {size}")
    return -(-size // multiple) * multiple


def default_model_config(vocab_size: int = DEFAULT_VOCAB_SIZE) -> dict[str, Any]:
    """The embedded default: a tiny Qwen3 (about 90k parameters at vocab 128).

    ``vocab_size`` is the tokenizer's size; it is rounded up to a multiple of 8
    here, so callers pass ``len(tokenizer)`` as is.  The dict is plain JSON
    (it travels in actor constructor arguments and is saved with the run).
    """
    return {
        "model_type": "qwen3",
        "vocab_size": round_vocab(vocab_size),
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "initializer_range": 0.02,
    }


def _read_fields(config: dict[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(config, (str, Path)):
        path = Path(config) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model directory {config!s} has no config.json")
        config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise TypeError(f"model config must be a dict or a directory path, got {type(config).__name__}")
    return dict(config)


def load_model_config(config: dict[str, Any] | str | Path) -> PretrainedConfig:
    """The transformers config of a dict or of a checkpoint directory's config.json.

    Raises ``ValueError`` naming the supported families for any other ``model_type``,
    and ``FileNotFoundError`` for a directory without ``config.json``.
    """
    from transformers import AutoConfig

    fields = _read_fields(config)
    model_type = fields.pop("model_type", "qwen3")
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_MODEL_TYPES.items())
        raise ValueError(f"model config: model_type {model_type!r} is not supported; supported: {supported}")
    # Saved configs carry bookkeeping keys that the strict config init refuses.
    for key in ("transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        fields.pop(key, None)
    return AutoConfig.for_model(model_type, **fields)


def build_model(config: dict[str, Any] | str | Path, seed: int = 0) -> PreTrainedModel:
    """Build the float32 transformers causal LM of ``config`` in eval mode.

    ``config`` is a config dict (random init under ``torch.manual_seed(seed)``,
    so the same dict and seed give the same weights in every process) or a
    local checkpoint directory holding ``config.json`` and ``*.safetensors``
    (HF parameter names; ``seed`` is then unused).  A checkpoint missing a
    parameter, or holding an unknown one, raises ``ValueError`` naming it.
    """
    import torch
    from transformers import AutoModelForCausalLM

    hf_config = load_model_config(config)
    # The global RNG is borrowed for the init and restored, so building a model
    # does not perturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model = model.to(torch.float32).eval()
    if isinstance(config, (str, Path)):
        _load_checkpoint(model, Path(config))
    return model


def _problem(exc: BaseException) -> str:
    """One bounded line for a loader's exception (safetensors, json, torch: many types)."""
    from orchestrator.runtime import clip

    text = str(exc).strip()
    return clip(f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__)


def read_tensors(path: str | Path, *, finite: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; with `finite`, floating-point tensors must hold
    no NaN or inf. Raises CheckpointError (one line naming the file and the problem) for a
    file that cannot be read (bad header, truncated data) or a non-finite value."""
    import torch
    from safetensors.torch import load_file

    from orchestrator.state.checkpoints import CheckpointError

    try:
        state = load_file(str(path))
    except Exception as e:  # safetensors' and the OS's many error types: one line
        raise CheckpointError(f"{path}: cannot be read: {_problem(e)}") from e
    if finite:
        for name, t in state.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                raise CheckpointError(f"{path}: tensor {name} holds {bad} non-finite value(s) (NaN or inf)")
    return state


def _load_checkpoint(model: PreTrainedModel, directory: Path) -> None:
    import torch

    from orchestrator.state.checkpoints import CheckpointError

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {directory} has no *.safetensors file")
    state: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    for file in files:
        part = read_tensors(file)
        state.update(part)
        where.update(dict.fromkeys(part, file))
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        # A tied head is saved once, as the embedding.
        state.pop("lm_head.weight", None)
        expected = {k: v for k, v in expected.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(state))
    unknown = sorted(set(state) - set(expected))
    if missing or unknown:
        raise CheckpointError(
            f"checkpoint {directory}: missing tensors {missing[:5]}, "
            f"unknown tensors {unknown[:5]}"
            + (f" ({len(missing) + len(unknown)} in all)" if len(missing) + len(unknown) > 10 else "")
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{where[name]}: tensor {name} has shape {tuple(tensor.shape)}, "
                f"model expects {tuple(expected[name].shape)}"
            )
    model.load_state_dict(
        {k: v.to(torch.float32) for k, v in state.items()}, strict=not model.config.tie_word_embeddings
    )


def checkpoint_params(directory: str | Path) -> tuple[int, int]:
    """(parameter count, bytes on disk) of a checkpoint's ``*.safetensors``, read from the
    files' headers only (nothing is loaded, so this is cheap for any size). Raises
    CheckpointError naming the file whose header cannot be read."""
    import struct

    from orchestrator.state.checkpoints import CheckpointError

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {directory} has no *.safetensors file")
    count = size = 0
    for f in files:
        size += f.stat().st_size
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > f.stat().st_size - 8:
                    raise ValueError(f"header length {n} exceeds the file")
                header = json.loads(fh.read(n))
            for name, entry in header.items():
                if name != "__metadata__":
                    numel = 1
                    for d in entry["shape"]:
                        numel *= int(d)
                    count += numel
        except (struct.error, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{f}: unreadable safetensors header: {_problem(e)}") from None
    return count, size


def model_weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The model's parameters by HF name, detached float32 copies (the master weights)."""
    return {name: t.detach().clone() for name, t in model.state_dict().items()}
