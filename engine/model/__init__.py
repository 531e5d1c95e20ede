"""The modules of HunyuanImage-3.0 (layers, attention, MoE, transformer, image heads, VAE, ViT), the
whole model as one rank keeps it resident, and its weight loading: each module that owns a packed
tensor-parallel parameter reads its own slice through `packed`, the one definition of the layout.

May import `engine.parallel`, `engine.checkpoint` and `hunyuan_kernels`; never the runtime or the server.
"""
