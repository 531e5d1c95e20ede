"""HunyuanImage-3.0 VAE (`AutoencoderKLConv3D`): a DC-AE style 3D-conv KL autoencoder.

Images are treated as short videos: encoding repeats the frame `ffactor_temporal` times so the
temporal downsampling collapses it to one latent frame; decoding expands one latent frame back to
`ffactor_temporal` frames and the last one is the image.

Module and parameter names follow the official checkpoint (`vae.` prefix stripped), so
`load_state_dict` on the released weights works unchanged. Tiling, slicing, gradient checkpointing
and the multi-GPU decoder of the official code are left out; they do not change the result.

Every forward op mirrors the official one (same op, same order, same in-place vs out-of-place
choice), so the module also matches the official numbers when the caller wraps it in
`torch.autocast` the way the official pipeline does. The convs and the GroupNorm + swish pairs run
as kernel ops (`conv3d_same`, `group_norm_swish`) whose references are those same ops; on CUDA the
fast backends compute the same math in fewer, faster passes (hunyuan_kernels/vae/conv.py,
hunyuan_kernels/vae/group_norm.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hunyuan_kernels as kernels

GROUPS = 32  # every GroupNorm of the official VAE uses 32 groups, eps 1e-6
EPS = 1e-6
LOGVAR_MIN, LOGVAR_MAX = -30.0, 20.0


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(GROUPS, channels, eps=EPS, affine=True)


class _Conv3d(nn.Conv3d):
    """A 'same' zero-padded 3D conv, run by the `conv3d_same` kernel op (on one frame it is the
    equivalent 2D conv; on CUDA fp16/bf16 a 2D conv over the frames, see hunyuan_kernels/vae/conv.py)."""

    def forward(self, x: Tensor) -> Tensor:
        w, b = self.weight, self.bias
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            # the cast autocast makes inside F.conv3d, made here so that the op is chosen for the dtype
            # it runs in
            dt = torch.get_autocast_dtype(dev)
            x, w, b = x.to(dt), w.to(dt), (b.to(dt) if b is not None else None)
        return kernels.call("conv3d_same", x, w, b, self.padding)


def _norm_swish(norm: nn.GroupNorm, x: Tensor) -> Tensor:
    """swish of the normed x (y * sigmoid(y), not F.silu: the official rounding and autocast
    behaviour) as a conv's input, one op; under autocast its result is already in the autocast
    dtype (the conv would cast it)."""
    dev = x.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    return kernels.call("group_norm_swish", x, norm.weight, norm.bias, norm.num_groups, norm.eps, dt)


def _conv(cin: int, cout: int, kernel: int = 3) -> nn.Conv3d:
    return _Conv3d(cin, cout, kernel_size=kernel, stride=1, padding=kernel // 2)


def _log2_exact(value: int, name: str) -> int:
    if value < 1 or value & (value - 1):
        raise ValueError(f"vae {name}={value} must be a power of two")
    return value.bit_length() - 1


def _space_to_channels(x: Tensor, rt: int) -> Tensor:
    """[B,C,T*rt,H*2,W*2] -> [B,(rt 2 2 C),T,H,W]: channel index = ((dt*2+dh)*2+dw)*C + c."""
    b, c, t, h, w = x.shape
    x = x.reshape(b, c, t // rt, rt, h // 2, 2, w // 2, 2)
    x = x.permute(0, 3, 5, 7, 1, 2, 4, 6)
    return x.reshape(b, rt * 4 * c, t // rt, h // 2, w // 2)


def _channels_to_space(x: Tensor, rt: int) -> Tensor:
    """Inverse of `_space_to_channels`: [B,(rt 2 2 C),T,H,W] -> [B,C,T*rt,H*2,W*2]."""
    b, ch, t, h, w = x.shape
    c = ch // (rt * 4)
    x = x.reshape(b, rt, 2, 2, c, t, h, w)
    x = x.permute(0, 4, 5, 1, 6, 2, 7, 3)
    return x.reshape(b, c, t * rt, h * 2, w * 2)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.norm1 = _norm(in_channels)
        self.conv1 = _conv(in_channels, out_channels)
        self.norm2 = _norm(out_channels)
        self.conv2 = _conv(out_channels, out_channels)
        # Only created on a width change (never with the released config).
        self.nin_shortcut = _conv(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(_norm_swish(self.norm1, x))
        h = self.conv2(_norm_swish(self.norm2, h))
        if self.nin_shortcut is not None:
            x = self.nin_shortcut(x)
        return x + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all T*H*W positions, head dim = channel count."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = _norm(channels)
        self.q = _conv(channels, channels, 1)
        self.k = _conv(channels, channels, 1)
        self.v = _conv(channels, channels, 1)
        self.proj_out = _conv(channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        b, c, t, hh, ww = x.shape

        def tokens(y: Tensor) -> Tensor:  # [B,C,T,H,W] -> [B,1,THW,C], contiguous as in the official code
            return y.reshape(b, c, t * hh * ww).transpose(1, 2).unsqueeze(1).contiguous()

        a = F.scaled_dot_product_attention(tokens(self.q(h)), tokens(self.k(h)), tokens(self.v(h)))
        a = a.squeeze(1).transpose(1, 2).reshape(b, c, t, hh, ww)
        return x + self.proj_out(a)


class DownsampleDCAE(nn.Module):
    """Halve H, W (and T if temporal): conv + pixel-unshuffle, plus a parameter-free shortcut that
    unshuffles the input and averages groups of consecutive channels down to `out_channels`."""

    def __init__(self, in_channels: int, out_channels: int, temporal: bool):
        super().__init__()
        self.rt = 2 if temporal else 1
        factor = self.rt * 4
        self.conv = _conv(in_channels, out_channels // factor)
        self.group_size = factor * in_channels // out_channels

    def forward(self, x: Tensor) -> Tensor:
        h = _space_to_channels(self.conv(x), self.rt)
        s = _space_to_channels(x, self.rt)
        b, _, t, hh, ww = s.shape
        s = s.reshape(b, h.shape[1], self.group_size, t, hh, ww).mean(dim=2)
        return h + s


class UpsampleDCAE(nn.Module):
    """Double H, W (and T if temporal): conv + pixel-shuffle, plus a shortcut that repeats each
    input channel and pixel-shuffles it."""

    def __init__(self, in_channels: int, out_channels: int, temporal: bool):
        super().__init__()
        self.rt = 2 if temporal else 1
        factor = self.rt * 4
        self.conv = _conv(in_channels, out_channels * factor)
        self.repeats = factor * out_channels // in_channels

    def forward(self, x: Tensor) -> Tensor:
        h = _channels_to_space(self.conv(x), self.rt)
        s = _channels_to_space(x.repeat_interleave(self.repeats, dim=1), self.rt)
        return h + s


class MidBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels)
        self.attn_1 = AttnBlock(channels)
        self.block_2 = ResnetBlock(channels, channels)

    def forward(self, x: Tensor) -> Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class Level(nn.Module):
    """One resolution level: ResNet blocks, then an optional resampler (`downsample`/`upsample`)."""

    def __init__(self, blocks: list[ResnetBlock], resample_name: str, resample: nn.Module | None):
        super().__init__()
        self.block = nn.ModuleList(blocks)
        self.resample_name = resample_name
        if resample is not None:
            self.add_module(resample_name, resample)

    def forward(self, x: Tensor) -> Tensor:
        for blk in self.block:
            x = blk(x)
        resample = getattr(self, self.resample_name, None)
        return x if resample is None else resample(x)


def _check_down(cin: int, cout: int, factor: int, where: str) -> None:
    if cout % factor or (factor * cin) % cout:
        raise ValueError(f"vae {where}: DC-AE downsample {cin}->{cout} needs out % {factor} == 0 "
                         f"and ({factor}*in) % out == 0")


def _check_up(cin: int, cout: int, factor: int, where: str) -> None:
    if (factor * cout) % cin:
        raise ValueError(f"vae {where}: DC-AE upsample {cin}->{cout} needs ({factor}*out) % in == 0")


class Encoder(nn.Module):
    def __init__(self, in_channels: int, z_channels: int, widths: list[int], num_res_blocks: int,
                 n_spatial: int, n_temporal: int, match_channel: bool):
        super().__init__()
        self.z_channels = z_channels
        self.conv_in = _conv(in_channels, widths[0])
        self.down = nn.ModuleList()
        cin = widths[0]
        for i, width in enumerate(widths):
            blocks = []
            for _ in range(num_res_blocks):
                blocks.append(ResnetBlock(cin, width))
                cin = width
            resample = None
            if i < n_spatial:  # the last n_temporal spatial levels also halve T
                temporal = i >= n_spatial - n_temporal
                cout = widths[i + 1] if match_channel else cin
                _check_down(cin, cout, 8 if temporal else 4, f"encoder level {i}")
                resample = DownsampleDCAE(cin, cout, temporal)
                cin = cout
            self.down.append(Level(blocks, "downsample", resample))
        self.mid = MidBlock(cin)
        self.norm_out = _norm(cin)
        self.conv_out = _conv(cin, 2 * z_channels)
        self.out_group = cin // (2 * z_channels)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv_in(x)
        for level in self.down:
            h = level(h)
        h = self.mid(h)
        b, c, t, hh, ww = h.shape
        # Shortcut to the 2*z moment channels: mean over groups of consecutive channels.
        shortcut = h.reshape(b, c // self.out_group, self.out_group, t, hh, ww).mean(dim=2)
        h = self.conv_out(_norm_swish(self.norm_out, h))
        h += shortcut  # in place, as official: the sum keeps conv_out's dtype under autocast
        return h


class Decoder(nn.Module):
    def __init__(self, z_channels: int, out_channels: int, widths: list[int], num_res_blocks: int,
                 n_spatial: int, n_temporal: int, match_channel: bool):
        super().__init__()
        self.in_repeats = widths[0] // z_channels
        cin = widths[0]
        self.conv_in = _conv(z_channels, cin)
        self.mid = MidBlock(cin)
        self.up = nn.ModuleList()
        for i, width in enumerate(widths):
            blocks = []
            for _ in range(num_res_blocks + 1):
                blocks.append(ResnetBlock(cin, width))
                cin = width
            resample = None
            if i < n_spatial:  # the first n_temporal levels also double T
                temporal = i < n_temporal
                cout = widths[i + 1] if match_channel else cin
                _check_up(cin, cout, 8 if temporal else 4, f"decoder level {i}")
                resample = UpsampleDCAE(cin, cout, temporal)
                cin = cout
            self.up.append(Level(blocks, "upsample", resample))
        self.norm_out = _norm(cin)
        self.conv_out = _conv(cin, out_channels)

    def forward(self, z: Tensor) -> Tensor:
        h = self.conv_in(z) + z.repeat_interleave(self.in_repeats, dim=1)
        h = self.mid(h)
        for level in self.up:
            h = level(h)
        return self.conv_out(_norm_swish(self.norm_out, h))


class AutoencoderKLConv3D(nn.Module):
    """The HunyuanImage-3.0 VAE. `cfg` is the `vae` dict of the model's config.json."""

    def __init__(self, cfg: dict):
        super().__init__()
        widths = [int(c) for c in cfg["block_out_channels"]]
        z = int(cfg["latent_channels"])
        self.ffactor_spatial = int(cfg["ffactor_spatial"])
        self.ffactor_temporal = int(cfg["ffactor_temporal"])
        # The official code skips scaling/shift when the value is falsy; 1.0 / None are the same no-ops.
        self.scaling_factor: float = float(cfg.get("scaling_factor") or 1.0)
        self.shift_factor: float | None = cfg.get("shift_factor") or None

        n_spatial = _log2_exact(self.ffactor_spatial, "ffactor_spatial")
        n_temporal = _log2_exact(self.ffactor_temporal, "ffactor_temporal")
        if n_temporal > n_spatial:
            raise ValueError("vae ffactor_temporal must not exceed ffactor_spatial")
        if n_spatial >= len(widths):
            raise ValueError(f"vae needs more than log2(ffactor_spatial)={n_spatial} levels, "
                             f"got block_out_channels of length {len(widths)}")
        if any(w % GROUPS for w in widths):
            raise ValueError(f"vae block_out_channels {widths} must all be multiples of {GROUPS} (GroupNorm groups)")
        if widths[-1] % (2 * z):
            raise ValueError(f"vae block_out_channels[-1]={widths[-1]} must be a multiple of "
                             f"2*latent_channels={2 * z}")
        num_res = int(cfg["layers_per_block"])
        self.encoder = Encoder(int(cfg["in_channels"]), z, widths, num_res, n_spatial, n_temporal,
                               bool(cfg.get("downsample_match_channel", True)))
        self.decoder = Decoder(z, int(cfg["out_channels"]), widths[::-1], num_res, n_spatial, n_temporal,
                               bool(cfg.get("upsample_match_channel", True)))

    def encode_moments(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """images [B,3,H,W] in [-1,1] -> (mean, logvar), each [B,C,1,h,w]; logvar clamped to [-30, 20]."""
        if images.ndim != 4 or images.shape[-1] % self.ffactor_spatial or images.shape[-2] % self.ffactor_spatial:
            raise ValueError(f"vae expects [B,C,H,W] with H, W multiples of {self.ffactor_spatial}, "
                             f"got {tuple(images.shape)}")
        # A still image is a clip of ffactor_temporal identical frames (collapses to 1 latent frame).
        x = images.unsqueeze(2).expand(-1, -1, self.ffactor_temporal, -1, -1)
        mean, logvar = self.encoder(x).chunk(2, dim=1)
        return mean, logvar.clamp(LOGVAR_MIN, LOGVAR_MAX)

    def encode_latent(self, images: Tensor, generator: torch.Generator | None) -> Tensor:
        """Posterior sample (mean + std*noise) times scaling_factor -> [B,C,h,w].

        The noise is drawn like diffusers' `randn_tensor` in the official posterior: one draw of the
        5-D moment shape in the moments' dtype (fp16 under the official autocast), made on the CPU
        and moved when the generator is a CPU one.
        """
        mean, logvar = self.encode_moments(images)
        draw_device = mean.device
        if generator is not None and generator.device.type != mean.device.type:
            if generator.device.type != "cpu":
                raise ValueError(f"cannot draw {mean.device} noise from a {generator.device} generator")
            draw_device = torch.device("cpu")
        noise = torch.randn(mean.shape, generator=generator, device=draw_device, dtype=mean.dtype).to(mean.device)
        latent = mean + torch.exp(0.5 * logvar) * noise
        if self.shift_factor is not None:
            latent = latent - self.shift_factor
        return (latent * self.scaling_factor).squeeze(2)

    def decode_latent(self, z: Tensor) -> Tensor:
        """Scaled latent [B,C,h,w] -> image [B,3,16h,16w] in about [-1,1] (the last decoded frame)."""
        z = z / self.scaling_factor
        if self.shift_factor is not None:
            z = z + self.shift_factor
        return self.decoder(z.unsqueeze(2))[:, :, -1]
