"""One rank of a plan at the real shapes on one GPU, for the model-level suites (tables, one-gpu,
prefill-host): the Instruct config (`instruct_config.json`, the released one), the rank's model with
random weights (quantized packs filled with random codes at a realistic level), the text positions and
an image-stage sequence, and the phase views whose collectives are `FakeComm` (shapes kept, nothing
moved). Every figure made with them is therefore compute only, for one rank, without communication."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from engine.model.attention import KVCache
from engine.model.hunyuan import HunyuanImage3
from engine.model.packed import PackFormat, QuantPack
from engine.parallel.fake import FakeComm
from engine.parallel.layout import PhaseView
from engine.parallel.plan import ParallelPlan
from engine.runtime.denoise import DenoiseLayout, DenoiseRunner, step_keys
from engine.runtime.graphs import Graphs
from engine.runtime.handoff import cache_heads
from engine.runtime.sequence import GenImageSpan, Sequence
from engine.checkpoint.config import ModelConfig

CONFIG = Path(__file__).with_name("instruct_config.json")
STD = 0.02                  # the float weights' std; quantized packs' scales are set to the same level
FP8_MAX = 448.0


def config(dry: bool, distil: bool = False) -> ModelConfig:
    """The real Instruct (or Instruct-Distil) config, or (dry) the tiny one a CPU run fits."""
    if dry:
        from tools.tiny import tiny_config
        base = tiny_config(512, distil=False)
    else:
        base = json.loads(CONFIG.read_text())
    return ModelConfig.from_dict(dict(base, cfg_distilled=True, use_meanflow=True) if distil else base)


def build(cfg: ModelConfig, plan: ParallelPlan, dtype: torch.dtype, device: str,
          resident: dict[str, PackFormat] | None = None) -> HunyuanImage3:
    """Rank 0's model of `plan`: floats N(0, STD), quantized packs (`resident`) random codes and scales."""
    model = HunyuanImage3(cfg, plan.layout(0), dtype, device, resident=resident)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        packs = [m for m in model.modules() if isinstance(m, QuantPack)]
        in_packs = {id(p) for m in packs for p in m.parameters()}
        for m in packs:
            _fill_pack(m, gen)
        for p in model.parameters():
            if id(p) not in in_packs:
                p.normal_(0, STD, generator=gen)
    return model.eval()


@torch.no_grad()
def _fill_pack(pack: QuantPack, gen: torch.Generator) -> None:
    """Random codes (every code value) and block scales near the level of weights of std STD."""
    f = pack.format.fmt
    dev = pack.codes.device
    codes = pack.codes.view(-1, pack.codes.shape[-1])
    scales = pack.scales.view(-1, pack.scales.shape[-1])
    for r in range(0, codes.shape[0], 8192):          # in slices: a whole expert pack's fp32 draw is GBs
        c = codes[r:r + 8192]
        if f in ("mxfp4", "nvfp4"):
            c.copy_(torch.randint(0, 256, c.shape, device=dev, dtype=torch.uint8, generator=gen))
        else:
            c.copy_((torch.randn(c.shape, device=dev, generator=gen) * 64).clamp(-FP8_MAX, FP8_MAX))
    jitter = torch.randint(-1, 2, scales.shape, device=dev, generator=gen)
    if f == "fp8":
        scales.copy_(STD / 64 * 2.0 ** jitter.float())
    elif f == "nvfp4":
        scales.copy_(4.0 * 2.0 ** jitter.float())
        pack.gscale.fill_(STD / 2.9 / 4)
    else:
        level = STD / (64 if f == "mxfp8" else 2.9)
        scales.copy_((round(math.log2(level)) + 127 + jitter).clamp(1, 254).to(torch.uint8))


def resident_gib(model: HunyuanImage3) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 30


def text_positions(n: int, device: str, block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and blocks of n text tokens ([start, stop) of `block`: one full-attention image block)."""
    pos = torch.arange(n, device=device).unsqueeze(1).repeat(1, 2)
    blocks = torch.full((n,), -1, device=device)
    if block:
        blocks[block[0]:block[1]] = 0
    return pos, blocks


def image_sequence(prefix: int, side: int, meta_tokens: int = 1) -> Sequence:
    """A stand-in image-stage sequence: `prefix` text tokens, <timestep> (Distil: and <guidance>
    <timestep_r>: meta_tokens 3), the side x side latent image, <eoi>."""
    meta, start, hw = prefix, prefix + meta_tokens, side * side
    n = start + hw + 1
    pos = [(i, i) for i in range(n)]
    for r in range(side):
        for c in range(side):
            pos[start + r * side + c] = (start + (hw - side) // 2 + r, start + (hw - side) // 2 + c)
    blocks = [-1] * n
    blocks[start:start + hw] = [0] * hw
    return Sequence(ids=[5] * n, uncondable=[False] * n, pos=pos, blocks=blocks,
                    gen_image=GenImageSpan(meta, start, side, side))


def ar_view(plan: ParallelPlan) -> PhaseView:
    """Rank 0's AR view: its one micro, tensor parallel over the plan's AR group."""
    return PhaseView(plan.micro(0), 1, FakeComm(plan.ar_tp))


def denoise_cache(model: HunyuanImage3, plan: ParallelPlan, seq: Sequence, branches: list[int]) -> KVCache:
    """The KV storage of rank 0's denoise phase of `seq` (every layer, one row per branch)."""
    heads = cache_heads(plan, 0, 0, model.transformer.layers[0].self_attn.kv_per_micro)
    scratch = max(len(seq), step_keys(seq.gen_image))
    return KVCache.allocate(model.cfg.num_layers, len(branches), heads.alloc.stop, scratch + 1, model.cfg.head_dim,
                            model.dtype, model.device)


def denoise_runner(model: HunyuanImage3, plan: ParallelPlan, seq: Sequence, prefix: int, branches: list[int],
                   graph: bool, cache: KVCache | None = None, graphs: Graphs | None = None) -> DenoiseRunner:
    """Rank 0's denoise phase of `seq`: the cond branch's prefix already in the cache (the KV hand-off),
    the uncond branch's to prefill (`runner.prefill`); CFG-parallel ranks run the cond branch alone.
    `cache` (from `denoise_cache`) and `graphs`, kept by the caller across runners, make a later runner
    replay the step graph the first one captured, as the engine's pool does (a graph replays on the KV
    storage it was captured on); without them each runner allocates its own and captures again."""
    dev = model.device
    view = PhaseView(0, plan.micros, FakeComm(plan.storage_tp), FakeComm(plan.sp), plan.sp_kind)
    heads = cache_heads(plan, 0, 0, model.transformer.layers[0].self_attn.kv_per_micro)
    scratch = max(len(seq), step_keys(seq.gen_image))       # past the step's keys (its tokens' cache place)
    cache = cache or denoise_cache(model, plan, seq, branches)
    starts = [prefix if b == 0 else 0 for b in branches]
    ids = torch.full((2, len(seq)), 5, device=dev)
    layout = DenoiseLayout(view, branches, starts, scratch, FakeComm(2 if plan.replica_mode == "cfg" else 1))
    return DenoiseRunner(model, seq, [], ids, cache.heads(heads.denoise), layout,
                         (graphs if graphs is not None else Graphs()) if graph else None)


def latent(model: HunyuanImage3, side: int, seed: int | None = None) -> torch.Tensor:
    """A random latent of the image; `seed`: drawn from its own generator (the same one whatever ran before)."""
    gen = torch.Generator(model.device).manual_seed(seed) if seed is not None else None
    return torch.randn(1, int(model.cfg.vae["latent_channels"]), side, side, device=model.device, generator=gen)
