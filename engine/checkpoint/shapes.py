"""The shapes the config gives the backbone's linears: the one table of them, read by the checkpoint plan
(engine/model/weights.py), the PEFT adapter reader (engine/model/peft.py) and the tools that write
checkpoints and adapters. From the config and the names alone, so every module of the model can ask it
without importing another."""
from __future__ import annotations

from engine.checkpoint import names
from engine.checkpoint.config import ModelConfig
from engine.checkpoint.names import DOWN_PROJ, GATE_AND_UP_PROJ


def backbone_linears(cfg: ModelConfig) -> dict[str, tuple[int, int, str | None]]:
    """Every linear that may be stored quantized: layer -> (N, K, what K is when the plan splits K, else None)."""
    H, D = cfg.hidden_size, cfg.head_dim
    out: dict[str, tuple[int, int, str | None]] = {}
    for i in range(cfg.num_layers):
        n = names.layer(i)
        I, Is = cfg.moe_intermediate_size[i], cfg.shared_intermediate(i)
        out[n.qkv_proj] = ((cfg.num_heads + 2 * cfg.num_kv_heads) * D, H, None)
        out[n.o_proj] = (H, cfg.num_heads * D, "the attention width (heads x head_dim)")
        if Is:
            out[n.shared(GATE_AND_UP_PROJ)] = (2 * Is, H, None)
            out[n.shared(DOWN_PROJ)] = (H, Is, f"layer {i}'s shared MLP intermediate size")
        for e in range(cfg.num_experts[i]):
            out[n.expert(e, GATE_AND_UP_PROJ)] = (2 * I, H, None)
            out[n.expert(e, DOWN_PROJ)] = (H, I, f"layer {i}'s expert intermediate size")
    return out
