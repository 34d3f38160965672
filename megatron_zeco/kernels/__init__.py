"""Triton kernels (GPU; on the CPU under TRITON_INTERPRET=1 for tests). Import submodules
explicitly: importing this package does not import Triton."""
