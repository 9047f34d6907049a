"""Random GGUF block data for tests: bytes of the right size per block with finite float16
scales (random bytes would give NaN / inf scales), as gguf's quantizer has no K-quant writer."""

from __future__ import annotations

import numpy as np

# ggml type id -> byte offsets of its float16 scales in a block
SCALE_OFFSETS = {8: (0,), 2: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def random_blocks(qtype: int, rows: int, in_features: int, seed: int = 0,
                  scale: float = 0.01) -> np.ndarray:
    """uint8 (rows, row bytes) of random blocks of `qtype` whose scales are about `scale`."""
    from omnistage.layers.gguf import FORMATS
    _, block, nbytes = FORMATS[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows * in_features // block, nbytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        d = (rng.uniform(0.5, 1.5, size=len(data)) * scale).astype(np.float16)
        data[:, offset:offset + 2] = d.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, -1)
