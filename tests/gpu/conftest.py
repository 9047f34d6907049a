"""GPU tests share one device with the stage processes they start: after each test, give the
memory this process cached back to the driver (an AR engine built in-process reserves its
memory_fraction of the device for its KV cache), or the next test's stages cannot size theirs.
`no_tf32`: float32 matmuls and convolutions without TF32, for the tests that compare with a
reference at float32 tolerances (`pytest.mark.usefixtures("no_tf32")`)."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def release_cuda_memory():
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture
def no_tf32():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
