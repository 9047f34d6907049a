"""GPU tests share one device with the stage processes they start: after each test, give the
memory this process cached back to the driver (an AR engine built in-process reserves its
memory_fraction of the device for its KV cache), or the next test's stages cannot size theirs."""

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
