"""Resampling at any pair of rates: the polyphase bank where it is small (bit for bit what it
was), the same filter evaluated per output sample elsewhere (coprime rates), memory bounded by
the audio's length, and rates outside MIN_SAMPLE_RATE .. MAX_SAMPLE_RATE refused."""

from __future__ import annotations

import subprocess
import sys
import textwrap




COMMENSURATE = [(16000, 24000), (44100, 16000), (22050, 16000), (48000, 16000), (24000, 8000),
                (8000, 22050)]


PAIRS = [(2999, 4001), (7919, 24000), (24000, 7919), (8001, 24000), (383_987, 1_009),
         (1_009, 48_017)]             # cheapest first: before the fix the first took a gigabyte


def test_memory_is_bounded_by_the_audio_whatever_the_rates() -> None:
    """In a fresh process, 2 s at each pair of rates: its peak resident memory may grow by
    100 MB at most (coprime pairs built a bank of target x orig taps: gigabytes); the child
    stops at the first pair past the bound."""
    code = textwrap.dedent("""
        import resource, sys
        import numpy as np
        from omnistage.utils.audio import resample
        resample(np.zeros(100, np.float32), 16000, 24000)            # torch's first call
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for pair in sys.argv[1:]:
            orig, target = map(int, pair.split(","))
            y = resample(np.random.default_rng(0).standard_normal(2 * orig)
                         .astype(np.float32), orig, target)
            grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
            print(orig, target, len(y), round(grew_mb, 1), flush=True)
            if grew_mb > 100:
                break
        """)
    done = subprocess.run([sys.executable, "-c", code, *(f"{o},{t}" for o, t in PAIRS)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    for (orig, target), (_, _, num_out, grew_mb) in zip(PAIRS, lines):
        assert float(grew_mb) < 100, (orig, target, grew_mb)
        assert int(num_out) == 2 * target
    assert len(lines) == len(PAIRS)

