"""Fused kernels for the hot path, each with a plain-PyTorch reference beside it.

Layers call these behind a switch; the reference defines the numbers the kernel must produce.
"""
