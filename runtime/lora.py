"""LoRA adapters on a training engine's model, with ``peft``.

:func:`add_adapters` injects peft's LoRA layers into the decoder's linear layers in place
(``peft.inject_adapter_in_model``: the model keeps its class and HF layout, so FSDP2, the
log-probability code and gradient checkpointing see the model they always see) and leaves
only the adapters trainable (and a critic's value head, which starts untrained).

Weights leave a LoRA engine **merged**: :func:`merge_adapters` turns the engine's parameters
(``….q_proj.base_layer.weight``, ``….q_proj.lora_A.default.weight``, …) into the HF names and
tensors of the model it computes (``W + alpha/rank · B·A``), so the weight sync, the rollout
engines (``vllm``, ``hf``) and the exported checkpoint need nothing LoRA-specific and cannot
run the base model by mistake. :func:`adapter_state` gives the adapters alone in peft's file
layout, written beside the exported model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from flowc.errors import SpecError
from flowc.ir.lora import LoraConfig

if TYPE_CHECKING:
    from peft import LoraConfig as PeftLoraConfig

ADAPTER = "default"  # peft's adapter name
_A, _B, _BASE = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight", ".base_layer."


def peft_config(lora: LoraConfig, *, base: str | None = None) -> PeftLoraConfig:
    """peft's ``LoraConfig`` of flowc's (``base``: the model the adapters go on, for a saved adapter)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.modules),
        bias="none",
        base_model_name_or_path=base,
    )


def add_adapters(model: nn.Module, lora: LoraConfig, *, seed: int, role: str) -> nn.Module:
    """Inject LoRA adapters into ``model``'s target layers (in place; the same initialisation on
    every rank, from ``seed``) and freeze everything else but a value head (``head``)."""
    from peft import inject_adapter_in_model

    torch.manual_seed(seed)  # A's initialisation must agree across ranks: FSDP2 does not broadcast it
    try:
        model = inject_adapter_in_model(peft_config(lora), model)
    except ValueError as e:
        raise SpecError(
            f"{role}: LoRA cannot adapt {', '.join(lora.modules)} of its model: {e}",
            fix="name linear layers the model has (optim.ROLE.lora.target_modules, e.g. [q_proj, v_proj])",
        ) from e
    from peft.tuners.lora import Linear as LoraLinear

    odd = [n for n, mod in model.named_modules() if hasattr(mod, "lora_A") and not isinstance(mod, LoraLinear)]
    if odd:  # e.g. fused expert tensors: their merge is not the linear layers' W + s·B·A
        raise SpecError(
            f"{role}: LoRA adapted {odd[0]}, which is not a linear layer (the merged weight sync handles linear layers only)",
            fix="name the attention projections only (optim.ROLE.lora.target_modules=[q_proj,k_proj,v_proj,o_proj])",
        )
    for name, p in model.named_parameters():
        p.requires_grad_(_is_adapter(name) or name == "head.weight")
    return model


def _is_adapter(name: str) -> bool:
    return name.endswith((_A, _B))


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def merge_adapters(params: dict[str, torch.Tensor], lora: LoraConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine's whole parameters with the adapters merged in, under HF names, in the
    model's order: ``x.base_layer.weight`` + ``scaling · lora_B @ lora_A`` → ``x.weight``,
    ``x.base_layer.bias`` → ``x.bias``; the adapters themselves are dropped. Lazily: one merged
    tensor exists at a time beyond ``params`` (a sync streams them straight into the engine)."""
    for name, t in params.items():
        if _is_adapter(name):
            continue
        if _BASE not in name:
            yield name, t
            continue
        module, _, leaf = name.rpartition(_BASE)
        if leaf == "weight":
            a, b = params[module + _A], params[module + _B]
            with torch.no_grad():
                t = (t.float() + lora.scaling * (b.float() @ a.float())).to(t.dtype)
        yield f"{module}.{leaf}", t


def adapter_state(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters under the names of peft's ``adapter_model.safetensors`` (what
    ``PeftModel.from_pretrained`` loads onto the base model)."""
    return {
        "base_model.model." + n.replace(f".{ADAPTER}.weight", ".weight"): t.contiguous()
        for n, t in params.items()
        if _is_adapter(n)
    }


def save_adapter(params: dict[str, torch.Tensor], lora: LoraConfig, base: str, path: str | Path) -> None:
    """The adapters as a peft adapter folder (``adapter_config.json``, ``adapter_model.safetensors``)
    for the base model ``base``."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    peft_config(lora, base=str(base)).save_pretrained(str(out))  # adapter_config.json
    save_file(adapter_state(params), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
