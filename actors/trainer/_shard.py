"""Turning the HF model into what the trainer optimises: adapters, checkpointing, FSDP2.

``Policy`` wraps the causal LM so that one ``forward`` computes the loss of a
micro-batch end to end (final hidden states, the replayed log-probs over the LM head,
the recipe loss). FSDP2 unshards a module's parameters only inside its ``forward``;
the union-of-supports path reads ``lm_head.weight`` directly instead of calling the
head, so the head must belong to a module whose forward is running: the ``Policy``
root. Units: one ``fully_shard`` per decoder layer, one for the root (embeddings,
final norm, LM head).

Order of preparation (each optional): LoRA adapters (``peft``), activation
checkpointing per decoder layer, then FSDP2 with a ``MixedPrecisionPolicy``
(bf16 compute, fp32 master weights and reductions). Gradients are reduced by SUM
(divide factor 1): every rank's loss is already divided by the global token count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from actors.trainer._config import TrainerConfig

__all__ = ["Policy", "lora_merge_plan", "prepare"]

LORA_ADAPTER = "default"


class Policy(nn.Module):
    """The causal LM plus a loss head: ``forward(input_ids, mask, rows, cols, loss_fn)``
    returns ``loss_fn(hidden[rows, cols], lm_head_weight, lm_head_bias)``, computed in
    fp32 whatever the compute dtype (an fp32 loss and fp32 log-softmax reductions)."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        rows: torch.Tensor,
        cols: torch.Tensor,
        loss_fn: Callable[..., Any],
    ) -> Any:
        out = self.hf.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden = out.last_hidden_state[rows, cols]
        head = self.hf.lm_head
        bias = head.bias.float() if head.bias is not None else None
        return loss_fn(hidden.float(), head.weight.float(), bias)


def _layers(hf: nn.Module) -> list[nn.Module]:
    return list(hf.model.layers)


def prepare(hf: nn.Module, config: TrainerConfig, *, sharded: bool, seed: int) -> Policy:
    """Adapters, activation checkpointing and (``sharded``) FSDP2 over the default process
    group, in place; returns the ``Policy`` to optimise (its ``hf`` is ``hf``).

    LoRA adapters are initialised under ``seed`` so every rank builds the same ones
    (FSDP2 keeps each rank's shard of its own full copy).
    """
    if config.lora is not None:
        _add_lora(hf, config, seed)
    if config.activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for layer in _layers(hf):
            checkpoint(layer)
    policy = Policy(hf)
    if sharded:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(config.device, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if config.dtype == "bf16" else None,
            reduce_dtype=torch.float32,
            output_dtype=None,
            cast_forward_inputs=True,
        )
        for layer in _layers(hf):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(policy, mesh=mesh, mp_policy=mp)
        for m in policy.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    elif config.dtype != "fp32":
        raise ValueError(f"trainer.dtype={config.dtype!r} needs the FSDP2 path (sharded=True)")
    return policy


def _add_lora(hf: nn.Module, config: TrainerConfig, seed: int) -> None:
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("trainer.lora needs peft: pip install 'flotilla[lora]'") from e
    assert config.lora is not None
    lc = LoraConfig(
        r=config.lora.r,
        lora_alpha=config.lora.alpha,
        lora_dropout=0.0,
        target_modules=list(config.lora.target_modules),
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        inject_adapter_in_model(lc, hf, adapter_name=LORA_ADAPTER)
    found = False
    for name, p in hf.named_parameters():
        is_adapter = ".lora_A." in name or ".lora_B." in name
        p.requires_grad_(is_adapter)
        found |= is_adapter
    if not found:
        raise ValueError(
            f"trainer.lora.target_modules {config.lora.target_modules} matched no linear module of the model"
        )


def lora_merge_plan(hf: nn.Module) -> dict[str, tuple[str, str, str, float]]:
    """For each adapted linear: HF weight name -> (base, lora_A, lora_B parameter names,
    scaling). The merged weight samplers use is ``base + scaling · (B @ A)``."""
    plan: dict[str, tuple[str, str, str, float]] = {}
    for mod_name, mod in hf.named_modules():
        if hasattr(mod, "base_layer") and hasattr(mod, "lora_A") and LORA_ADAPTER in mod.lora_A:
            plan[f"{mod_name}.weight"] = (
                f"{mod_name}.base_layer.weight",
                f"{mod_name}.lora_A.{LORA_ADAPTER}.weight",
                f"{mod_name}.lora_B.{LORA_ADAPTER}.weight",
                float(mod.scaling[LORA_ADAPTER]),
            )
    return plan


def hf_name(name: str) -> str:
    """The HF name of a (possibly LoRA-wrapped) parameter: ``x.base_layer.bias`` -> ``x.bias``."""
    return name.replace(".base_layer.", ".")


def is_sharded(config: TrainerConfig) -> bool:
    """Whether ``config`` takes the FSDP2 path: several ranks, bf16 compute (FSDP2's
    mixed precision) or LoRA (its checkpoints are distributed checkpoints)."""
    return config.procs > 1 or config.dtype != "fp32" or config.lora is not None
