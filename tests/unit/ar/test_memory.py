"""KV-cache sizing on a GPU from the measured numbers (the measuring itself runs in
tests/gpu): what fits the stage's share after its weights and activation peak, bounded by
what is free on the device; a clear error with the numbers when nothing fits."""

from __future__ import annotations

import pytest

from omnistage.ar.memory import gpu_kv_blocks

GIB = 2**30


def test_blocks_fit_the_share_after_weights_and_peak() -> None:
    # 0.5 of 80 GiB = 40 GiB - 10 GiB weights - 2 GiB peak = 28 GiB of 1 MiB blocks
    assert gpu_kv_blocks(0.5, 80 * GIB, 10 * GIB, 2 * GIB, 70 * GIB, 2**20) == 28 * 1024


def test_what_is_free_bounds_the_share() -> None:
    # another process holds most of the device: 20 GiB free - 2 GiB peak
    assert gpu_kv_blocks(0.9, 80 * GIB, 10 * GIB, 2 * GIB, 20 * GIB, 2**20) == 18 * 1024


def test_no_room_names_the_numbers_and_the_ways_out() -> None:
    with pytest.raises(RuntimeError, match=(
            r"no memory left for the KV cache \(memory_fraction 0\.75 of 79\.6 GiB = 59\.7 GiB; "
            r"weights 59\.00 GiB, activation peak 1\.00 GiB, free on the device now 20\.0 GiB; "
            r"one block needs 0\.38 MiB\): raise memory_fraction .* other GPUs")):
        gpu_kv_blocks(0.75, int(79.6 * GIB), 59 * GIB, GIB, 20 * GIB, 393216)
