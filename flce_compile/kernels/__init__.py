"""Triton kernels, one a file."""
