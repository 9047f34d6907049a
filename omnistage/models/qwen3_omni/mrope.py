"""Qwen3-Omni's multimodal rotary positions (3, L): text and audio count up on all three axes;
an image / video block gets (t, row, col) offsets from where it starts, and the text after it
resumes at the block's largest position + 1.

A video that holds its audio track (`use_audio_in_video`: its first token follows
`audio_start_token_id`) is one block of its video and `audio_token_id` tokens, interleaved
between <|audio_start|> and <|audio_end|> (what the reference's `get_rope_index` looks for):
both count from the block's start, the video tokens as above and the audio tokens one position
each (audio_block_positions). `shared_brackets` (Qwen2.5-Omni): <|vision_start|> and
<|audio_start|> share a position, and so do <|audio_end|> and <|vision_end|>."""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import torch
from torch import Tensor


def mrope_positions(input_ids: Sequence[int] | Tensor, *, image_token_id: int,
                    video_token_id: int, spatial_merge_size: int, position_id_per_seconds: float,
                    image_grid_thw: Tensor | None = None, video_grid_thw: Tensor | None = None,
                    video_second_per_grid: Sequence[float] | Tensor | None = None,
                    truncate_time: bool = False, audio_token_id: int | None = None,
                    audio_start_token_id: int | None = None, shared_brackets: bool = False
                    ) -> tuple[Tensor, int]:
    """The thinker's 3-axis rotary positions (3, L) int64 and the rope delta (decode step n of
    a prompt of L tokens sits at position L + n + delta on every axis), equal to HF's
    `get_rope_index` for text, audio, image and video prompts.

    Every run of image (video) placeholder tokens is one image (video), in grid order. Its
    positions are start + (t * seconds_per_grid * position_id_per_seconds, row, col) over the
    merged grid (images: one second per grid), where start is the position its first token
    would have had as text; the next token continues at the block's largest position + 1.
    `truncate_time`: t * step rounded down (Qwen2.5-Omni's `get_rope_index`) where a
    fractional step is otherwise refused. The audio_* / shared_*: audio in video (above)."""
    ids = input_ids.tolist() if isinstance(input_ids, Tensor) else list(input_ids)
    grids, seconds = _grids_by_token(image_token_id, video_token_id, image_grid_thw,
                                     video_grid_thw, video_second_per_grid)
    used = {image_token_id: 0, video_token_id: 0}
    pieces: list[Tensor] = []
    next_pos = text_start = 0
    for i, j, token in _placeholder_runs(ids, grids.keys()):
        if i < text_start:                         # inside an audio-in-video block already done
            continue
        kind, k = ("image" if token == image_token_id else "video"), used[token]
        if k >= len(grids[token]):
            raise ValueError(f"input_ids: more {kind} placeholder runs than {kind} grids "
                             f"({len(grids[token])})")
        with_audio = (kind == "video" and audio_start_token_id is not None and i > 0
                      and ids[i - 1] == audio_start_token_id)
        shared = with_audio and shared_brackets
        if i - shared > text_start:                              # text / audio: count up
            pieces.append(torch.arange(next_pos, next_pos + i - shared - text_start).expand(3, -1))
            next_pos += i - shared - text_start
        if shared:                                 # <|audio_start|> where <|vision_start|> is
            pieces.append(torch.full((3, 1), next_pos - 1))
        if with_audio:
            j = _block_end(ids, i, {token, audio_token_id})
        is_visual = torch.tensor(ids[i:j]) == token
        block = audio_block_positions(is_visual, _visual_positions(
            f"{kind} {k}", grids[token][k], int(is_visual.sum()), spatial_merge_size,
            seconds[token][k], position_id_per_seconds, truncate_time)) + next_pos
        pieces.append(block)
        next_pos = int(block.max()) + 1
        if shared:                                 # <|audio_end|> and <|vision_end|>: one place
            pieces.append(torch.full((3, 2), next_pos))
            next_pos, j = next_pos + 1, j + 2
        used[token] += 1
        text_start = j
    if len(ids) > text_start:
        pieces.append(torch.arange(next_pos, next_pos + len(ids) - text_start).expand(3, -1))
        next_pos += len(ids) - text_start
    for token, kind in ((image_token_id, "image"), (video_token_id, "video")):
        if used[token] != len(grids[token]):
            raise ValueError(f"input_ids: {used[token]} {kind} placeholder runs for "
                             f"{len(grids[token])} {kind} grids")
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    return positions, (next_pos - len(ids))


def _grids_by_token(image_token_id: int, video_token_id: int, image_grid_thw: Tensor | None,
                    video_grid_thw: Tensor | None,
                    video_second_per_grid: Sequence[float] | Tensor | None,
                    ) -> tuple[dict[int, list[list[int]]], dict[int, list[float]]]:
    """Placeholder token -> its grids (t, h, w) in order, and -> seconds per grid of each
    (images: one second)."""
    grids = {image_token_id: image_grid_thw.tolist() if image_grid_thw is not None else [],
             video_token_id: video_grid_thw.tolist() if video_grid_thw is not None else []}
    seconds = {image_token_id: [1.0] * len(grids[image_token_id]),
               video_token_id: [float(s) for s in (video_second_per_grid if
                                video_second_per_grid is not None else [])]}
    if len(seconds[video_token_id]) != len(grids[video_token_id]):
        raise ValueError(f"video_second_per_grid has {len(seconds[video_token_id])} entries for "
                         f"{len(grids[video_token_id])} videos")
    return grids, seconds


def _placeholder_runs(ids: list[int], tokens: Iterable[int]) -> Iterator[tuple[int, int, int]]:
    """(start, end, token) of every maximal run of one placeholder token in `ids`, in order."""
    wanted = set(tokens)
    i = 0
    while i < len(ids):
        if ids[i] not in wanted:
            i += 1
            continue
        j = i + 1
        while j < len(ids) and ids[j] == ids[i]:
            j += 1
        yield i, j, ids[i]
        i = j


def _visual_positions(what: str, grid: Sequence[int], num_tokens: int, merge: int,
                      seconds: float, per_second: float, truncate_time: bool) -> Tensor:
    """(3, t*h*w) positions (t * step, row, col) of one image / video over its merged grid,
    from 0, step = seconds per grid x positions per second; checks its placeholder count and
    that the step is whole, or rounds t * step down in float32 as Qwen2.5-Omni's reference."""
    t, h, w = (int(x) for x in grid)
    h, w = h // merge, w // merge
    if num_tokens != t * h * w:
        raise ValueError(f"input_ids: {what} has {num_tokens} placeholder tokens, its grid "
                         f"{list(grid)} needs {t * h * w}")
    step = seconds * per_second
    if truncate_time:
        times = (torch.arange(t) * torch.tensor(seconds, dtype=torch.float32) * per_second).long()
    elif step != int(step):
        raise ValueError(f"{what}: {step:g} positions per grid (seconds per grid x "
                         "position_id_per_seconds) is not a whole number")
    else:
        times = torch.arange(t) * int(step)
    t_idx = times.view(t, 1, 1).expand(t, h, w)
    h_idx = torch.arange(h).view(1, h, 1).expand(t, h, w)
    w_idx = torch.arange(w).view(1, 1, w).expand(t, h, w)
    return torch.stack([t_idx, h_idx, w_idx]).reshape(3, -1)


def audio_block_positions(is_video: Tensor, video_positions: Tensor) -> Tensor:
    """(3, n) positions of an audio-in-video block from its start: the video tokens (where
    `is_video`) take `video_positions` in order, the audio tokens 0, 1, 2, ... on all axes."""
    num_audio = int((~is_video).sum())
    if not num_audio:
        return video_positions
    out = torch.empty(3, is_video.numel(), dtype=torch.long)
    out[:, is_video] = video_positions
    out[:, ~is_video] = torch.arange(num_audio).expand(3, -1)
    return out


def _block_end(ids: list[int], start: int, inside: set[int | None]) -> int:
    """The index of the first token from `start` that is not one of `inside`."""
    j = start
    while j < len(ids) and ids[j] in inside:
        j += 1
    return j
