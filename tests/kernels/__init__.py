"""Kernel layer (``lightning_onebit/kernels/``): sign packing, 1-bit compression and the frozen-Adam update,
in torch, native C and cupy, each checked bit for bit."""
