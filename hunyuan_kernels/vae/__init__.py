"""The VAE's fused ops: `conv3d_same` (its 3D convs as 2D convs over frames, conv.py) and
`group_norm_swish` (group_norm.py), each with its reference and its CUDA variant."""
from __future__ import annotations

from . import conv, group_norm  # noqa: F401  (register the ops)
