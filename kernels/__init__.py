"""GPU kernels with a plain-PyTorch fallback each."""
