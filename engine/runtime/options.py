"""What an engine is asked for besides its model and its ranks: its sizes (requests at once in each phase,
the bounds of the conversations' caches) and how its requests run (previews, CUDA graphs, the CFG
branches, the KV hand-off). The fields an engine's configuration also has carry the same names there
(engine/serve/engine_config.py, read by `Engine.from_config`): a setting is never renamed on its way."""
from __future__ import annotations

from dataclasses import dataclass

from engine.runtime.lru import ENCODING_CACHE_MB, PREFIX_CACHE_MB


@dataclass(frozen=True)
class EngineOptions:
    max_batch: int = 1                  # requests in their AR phase at once (the KV pool's AR slots)
    max_denoise_batch: int = 1          # requests of one denoise step key whose steps share a forward
    preview_every: int = 1              # a step preview every this many denoise steps (0: none)
    cfg_serial: bool = False            # CFG branches one after the other (less activation memory)
    cuda_graph: bool = True             # steps as CUDA-graph replays where every kernel can be captured
    # how decode and denoise steps share the device (scheduler.POLICIES); None: plan.default_step_policy
    step_policy: str | None = None
    # each decode step launches the next before its tokens are read (scheduler.py, 3.); None: on a GPU (on a
    # CPU the forward launched ahead runs before the read, hiding nothing)
    decode_lookahead: bool | None = None
    prefix_cache_bytes: int = PREFIX_CACHE_MB << 20      # conversations' K/V prefixes (prefix_cache.py; 0: off)
    encoding_cache_bytes: int = ENCODING_CACHE_MB << 20  # their images' encodings (conditioning.py; 0: none)
    kv_handoff: bool = True             # the denoise phase reuses the cond prefix the AR phase wrote (off: tests)
    # previews may take at most this share of the denoise compute: on a CPU one preview (a VAE decode) costs
    # several denoise steps of a small model, so they are skipped until it is paid for; on a GPU it is cheap
    # beside a step and every step gets one
    preview_share: float = 0.25
    preview_tokens: int | None = None   # a preview decodes a pooled latent of at most this many tokens
                                        # (None: 256 on a GPU, 64 on a CPU)
