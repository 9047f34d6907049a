"""The order of a video's tokens and its audio track's tokens in one block (Qwen-Omni's
`use_audio_in_video`). Both are placed by time, counted in rotary positions from the block's
start: video token (t, row, col) at t * seconds_per_grid * position_id_per_seconds, audio token
k at k (one audio token per position).

    Qwen3-Omni     merge_by_time: token by token, a video token first when its time is not
                   later than the next audio token's
    Qwen2.5-Omni   by_chunks: chunks of seconds_per_chunk; in each chunk its video tokens,
                   then its audio tokens

    video times   0 0 0 0 25 25 25 25 50 50 50 50      (4 tokens a grid, 25 positions apart)
    audio         0 1 2 ... 59
    merge_by_time V V V V A x25 V V V V A x25 V V V V A x10
    by_chunks     V x8 A x50 | V x4 A x10              (chunks of 50 positions)
"""

from __future__ import annotations

from collections.abc import Sequence


def video_token_times(grid_thw: Sequence[int], merge: int, seconds_per_grid: float,
                      position_id_per_seconds: float) -> list[float]:
    """Each merged video token's time in positions, in token order (t, row, col)."""
    t, h, w = (int(x) for x in grid_thw)
    per_grid = (h // merge) * (w // merge)
    return [k * seconds_per_grid * position_id_per_seconds
            for k in range(t) for _ in range(per_grid)]


def merge_by_time(video_times: Sequence[float], num_audio: int) -> list[tuple[bool, int]]:
    """Runs (is_video, count) of the two streams merged token by token by time."""
    runs: list[tuple[bool, int]] = []
    v = a = 0
    while v < len(video_times) or a < num_audio:
        is_video = a >= num_audio or (v < len(video_times) and video_times[v] <= a)
        if runs and runs[-1][0] == is_video:
            runs[-1] = (is_video, runs[-1][1] + 1)
        else:
            runs.append((is_video, 1))
        v, a = (v + 1, a) if is_video else (v, a + 1)
    return runs


def by_chunks(video_times: Sequence[float], num_audio: int, tokens_per_chunk: int
              ) -> list[tuple[bool, int]]:
    """Runs (is_video, count): chunk j's video tokens (times in [j, j+1) x tokens_per_chunk,
    counted as the reference counts them: a chunk ends at the first later token), then its
    audio tokens; chunks past the end of one stream bring only the other's."""
    video = _chunk_sizes(video_times, tokens_per_chunk)
    audio = _chunk_sizes(range(num_audio), tokens_per_chunk)
    runs: list[tuple[bool, int]] = []
    for j in range(max(len(video), len(audio))):
        for is_video, sizes in ((True, video), (False, audio)):
            if j < len(sizes) and sizes[j]:
                runs.append((is_video, sizes[j]))
    return runs


def _chunk_sizes(times: Sequence[float], tokens_per_chunk: int) -> list[int]:
    """Sizes of consecutive chunks of increasing `times`: a new chunk starts at the first
    time >= (chunks so far) x tokens_per_chunk; one chunk at least (empty for no tokens)."""
    sizes, start, chunk = [], 0, 1
    for i, time in enumerate(times):
        if time >= chunk * tokens_per_chunk:
            sizes.append(i - start)
            start, chunk = i, chunk + 1
    sizes.append(len(times) - start)
    return sizes


def tokens_per_chunk(position_id_per_seconds: float, seconds_per_chunk: float) -> int:
    return int(position_id_per_seconds * seconds_per_chunk)

