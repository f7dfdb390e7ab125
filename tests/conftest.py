"""Shared test set-up: the `gpu` marker skips without CUDA; without CUDA the Triton kernels run in the
interpreter (TRITON_INTERPRET=1 must be set before the kernel module is imported)."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
