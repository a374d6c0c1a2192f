"""Small LoRA adapters for the real default model, made here with a fixed seed (none ships on PyPI).

B matrices are drawn from N(0, `scale`) rather than peft's zeros: an adapter that starts at zero changes
nothing. Measured on SmolLM2-135M (q_proj/v_proj, r=8, alpha=r): 0.3 gives fluent answers that differ from
the base's and from each other; 0.6 and more make the model ramble or babble.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kite_shared import adapters
from kite_shared.config import ModelConfig, load
from kite_shared.model_store import LocalModel, identity, load_causal_lm, prepare
from kite_shared.tiers.keys import model_tag


def make_lora_adapters(local: LocalModel, cfg: ModelConfig, folders: dict[Path, int], scale: float = 0.3,
                       rank: int = 8) -> None:
    """Write one declared LoRA adapter (q_proj and v_proj, rank `rank`) per folder, seeded by its value."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_causal_lm(local, cfg),
                           LoraConfig(r=rank, lora_alpha=rank, target_modules=["q_proj", "v_proj"]))
    for folder, seed in folders.items():
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_A" in name:  # peft's own range (kaiming uniform), drawn from the seed
                    bound = 1 / param.shape[1] ** 0.5
                    param.copy_((torch.rand(param.shape, generator=generator) * 2 - 1) * bound)
                elif "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * scale)
        model.save_pretrained(folder)
        adapters.declare(folder, local, cfg.block_size)


def served_adapters(folder: Path, engine: str, seeds: dict[str, int]) -> tuple[str, dict[str, str]]:
    """Adapters made in `folder` (name -> seed) and declared for `engine`'s base: their KITE_ADAPTERS
    setting, and each one's model tag in the tiers (the base's under "")."""
    cfg = load(ModelConfig, engine=engine)
    local = prepare(cfg)
    make_lora_adapters(local, cfg, {folder / name: seed for name, seed in seeds.items()})
    setting = ",".join(f"{name}={folder / name}" for name in seeds)
    base = identity(local, cfg)
    served = adapters.load_configured(load(ModelConfig, engine=engine, adapters=setting), local, base)
    tags = {name: model_tag(a.identity.fingerprint_hex) for name, a in served.items()}
    tags[""] = model_tag(base.fingerprint_hex)
    return setting, tags
