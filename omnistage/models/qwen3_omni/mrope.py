"""Qwen3-Omni's multimodal rotary positions (3, L): text and audio count up on all three axes;
an image / video block gets (t, row, col) offsets from where it starts, and the text after it
resumes at the block's largest position + 1."""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import torch
from torch import Tensor


def mrope_positions(input_ids: Sequence[int] | Tensor, *, image_token_id: int,
                    video_token_id: int, spatial_merge_size: int, position_id_per_seconds: float,
                    image_grid_thw: Tensor | None = None, video_grid_thw: Tensor | None = None,
                    video_second_per_grid: Sequence[float] | Tensor | None = None,
                    truncate_time: bool = False) -> tuple[Tensor, int]:
    """The thinker's 3-axis rotary positions (3, L) int64 and the rope delta (decode step n of
    a prompt of L tokens sits at position L + n + delta on every axis), equal to HF's
    `get_rope_index` for text, audio, image and video prompts (audio-in-video excepted).

    Every run of image (video) placeholder tokens is one image (video), in grid order. Its
    positions are start + (t * seconds_per_grid * position_id_per_seconds, row, col) over the
    merged grid (images: one second per grid), where start is the position its first token
    would have had as text; the next token continues at the block's largest position + 1.
    `truncate_time`: t * step rounded down (Qwen2.5-Omni's `get_rope_index`) where a
    fractional step is otherwise refused."""
    ids = input_ids.tolist() if isinstance(input_ids, Tensor) else list(input_ids)
    grids, seconds = _grids_by_token(image_token_id, video_token_id, image_grid_thw,
                                     video_grid_thw, video_second_per_grid)
    used = {image_token_id: 0, video_token_id: 0}
    pieces: list[Tensor] = []
    next_pos = text_start = 0
    for i, j, token in _placeholder_runs(ids, grids.keys()):
        if i > text_start:                                       # text / audio: count up
            pieces.append(torch.arange(next_pos, next_pos + i - text_start).expand(3, -1))
            next_pos += i - text_start
        kind = "image" if token == image_token_id else "video"
        k = used[token]
        if k >= len(grids[token]):
            raise ValueError(f"input_ids: more {kind} placeholder runs than {kind} grids "
                             f"({len(grids[token])})")
        block = _visual_positions(f"{kind} {k}", grids[token][k], j - i, spatial_merge_size,
                                  seconds[token][k], position_id_per_seconds,
                                  truncate_time) + next_pos
        pieces.append(block)
        next_pos = int(block.max()) + 1
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
