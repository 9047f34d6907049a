"""Golden: our LTX-2 transformer against diffusers' `LTX2VideoTransformer3DModel` on the same
tiny random weights (loaded by our loader from the saved folder), float32: a batch of 2 at
different timesteps, an odd latent grid (3 x 2 x 5) and audio length (7), a text mask with
padding in one row; with and without the audio-video attention (isolate_modalities), and the
"split" rope with per-head attention gates of later checkpoints; STG's perturbed blocks. Both
outputs, video and audio."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.models.ltx2_transformer import LTX2VideoTransformer3DModel, Positions
from tests.helpers.ltx2 import CAPTION, TRANSFORMER, tiny_transformer

pytest.importorskip("diffusers")

GRID, AUDIO_FRAMES, TEXT = (3, 2, 5), 7, 6


def _inputs() -> dict:
    g = torch.Generator().manual_seed(3)
    f, h, w = GRID
    mask = torch.ones(2, TEXT)
    mask[1, :2] = 0
    return dict(
        hidden_states=torch.randn(2, f * h * w, TRANSFORMER["in_channels"], generator=g),
        audio_hidden_states=torch.randn(2, AUDIO_FRAMES, TRANSFORMER["audio_in_channels"],
                                        generator=g),
        encoder_hidden_states=torch.randn(2, TEXT, CAPTION, generator=g),
        audio_encoder_hidden_states=torch.randn(2, TEXT, CAPTION, generator=g),
        timestep=torch.tensor([900.0, 250.0]), encoder_attention_mask=mask)


def _compare(tmp_path: Path, isolate: bool = False, fps: float = 24.0,
             stg: tuple[int, ...] = (), **config) -> None:
    ref = tiny_transformer(**config)
    ref.save_pretrained(tmp_path)
    ours = LTX2VideoTransformer3DModel.from_pretrained(tmp_path)
    kw = _inputs()
    f, h, w = GRID
    with torch.no_grad():
        video, audio = ref(**kw, audio_encoder_attention_mask=kw["encoder_attention_mask"],
                           sigma=kw["timestep"], num_frames=f, height=h, width=w, fps=fps,
                           audio_num_frames=AUDIO_FRAMES, use_cross_timestep=True,
                           isolate_modalities=isolate, return_dict=False,
                           spatio_temporal_guidance_blocks=list(stg) or None)
        got_video, got_audio = ours(**kw, positions=Positions(GRID, fps, AUDIO_FRAMES),
                                    use_cross_timestep=True, isolate_modalities=isolate,
                                    stg_blocks=stg)
    for got, expected in ((got_video, video), (got_audio, audio)):
        assert expected.abs().mean() > 0.5, float(expected.abs().mean())
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_matches_diffusers(tmp_path: Path) -> None:
    _compare(tmp_path)


def test_isolated_modalities_match_diffusers(tmp_path: Path) -> None:
    _compare(tmp_path, isolate=True, fps=25.0)


def test_split_rope_and_gated_attention_match_diffusers(tmp_path: Path) -> None:
    _compare(tmp_path, rope_type="split", gated_attn=True, audio_gated_attn=True)


def test_stg_perturbed_blocks_match_diffusers(tmp_path: Path) -> None:
    """STG's pass: block 1's self-attentions skipped (their values stand in), gated too."""
    _compare(tmp_path, stg=(1,), perturbed_attn=True, rope_type="split",
             gated_attn=True, audio_gated_attn=True)


def test_unsupported_config_is_refused(tmp_path: Path) -> None:
    tiny_transformer(cross_attn_mod=True).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="cross_attn_mod"):
        LTX2VideoTransformer3DModel.from_pretrained(tmp_path)
