"""A tiny random Qwen2.5-Omni checkpoint (`Qwen2_5OmniForConditionalGeneration`) built with
transformers' own classes, for golden tests of its thinker (with its audio and vision
encoders), talker and token2wav.

    path = build_tiny_qwen2_5_omni(tmp_path / "omni25")   # config.json, safetensors,
                                                          # tokenizer, spk_dict.pt,
                                                          # preprocessor_config.json

The tokenizer is Qwen3-Omni's tiny one (tiny_omni.py): the config's placeholder and tts ids
point at its special tokens. The speaker map (spk_dict.pt, what `from_pretrained` loads) holds
two speakers, each with its text bos id, a conditioning vector and a reference mel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omnistage.testing.tiny_omni import (_randomize, build_tiny_omni_tokenizer,
                                         save_tiny_omni_processor)

# the talker's codec vocabulary: codes 0..63, then its specials (pad, bos, eos, mask)
NUM_CODES = 64
CODEC_VOCAB = 80
CODEC_PAD, CODEC_BOS, CODEC_EOS, CODEC_MASK = 72, 73, 74, 76
SPEAKERS = ("Chelsie", "Ethan")
MEL_DIM = 16
# streamed token2wav against the whole decode on this checkpoint, at the shipped chunking
# (scripts/measure_token2wav_seams.py, 120 codes: largest error 3.1e-5 at a peak of 0.62,
# 98 dB; with 1 block of context a side: 9.2e-4, 67 dB): the bounds the tests hold it to
SEAM_TOLERANCE = 2e-4
SEAM_MIN_SNR_DB = 80.0
# the released DiT's attention pattern (blocks of 24 mel frames; layers 0 and 20 see the block
# before, layer 10 the block after), at the tiny width
RELEASED_DIT_BLOCKS = dict(block_size=24, num_hidden_layers=22, look_ahead_layers=[10],
                           look_backward_layers=[0, 20])


def tiny_qwen2_5_omni_config(tokenizer: Any, dit_overrides: dict | None = None):
    """dit_overrides: token2wav DiT fields to change (the released attention pattern:
    RELEASED_DIT_BLOCKS)."""
    from transformers import Qwen2_5OmniConfig

    tid = tokenizer.convert_tokens_to_ids
    thinker_rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    talker_rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]}
    ids = dict(audio_token_index=tid("<|audio_pad|>"), image_token_index=tid("<|image_pad|>"),
               video_token_index=tid("<|video_pad|>"),
               audio_start_token_id=tid("<|audio_start|>"),
               audio_end_token_id=tid("<|audio_end|>"), position_id_per_seconds=25)
    thinker = dict(
        audio_config=dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2,
                          encoder_ffn_dim=64, d_model=32, output_dim=64, n_window=50,
                          max_source_positions=1500),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           in_channels=3, patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=16, out_hidden_size=64,
                           fullatt_block_indexes=[1]),
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, rope_parameters=thinker_rope,
                         rms_norm_eps=1e-6, tie_word_embeddings=False),
        user_token_id=tid("user"), vision_start_token_id=tid("<|vision_start|>"),
        vision_end_token_id=tid("<|vision_end|>"), **ids)
    talker = dict(
        vocab_size=CODEC_VOCAB, embedding_size=64, hidden_size=48, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
        max_position_embeddings=4096, rope_parameters=talker_rope, rms_norm_eps=1e-6,
        tts_text_start_token_id=tid("<|tts_bos|>"), tts_text_end_token_id=tid("<|tts_eos|>"),
        tts_text_pad_token_id=tid("<|tts_pad|>"), tts_codec_start_token_id=CODEC_BOS,
        tts_codec_end_token_id=CODEC_EOS, tts_codec_pad_token_id=CODEC_PAD,
        tts_codec_mask_token_id=CODEC_MASK, vision_start_token_id=tid("<|vision_start|>"),
        vision_end_token_id=tid("<|vision_end|>"), spatial_merge_size=2, **ids)
    dit = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, head_dim=16,
               ff_mult=2, emb_dim=16, block_size=4, look_ahead_layers=[1],
               look_backward_layers=[0, 2], repeats=2, num_embeds=CODEC_VOCAB, mel_dim=MEL_DIM,
               enc_emb_dim=16, enc_dim=16, enc_channels=[16, 16, 16, 16, 48],
               enc_attention_channels=8, enc_se_channels=8, max_position_embeddings=4096,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    dit.update(dit_overrides or {})
    bigvgan = dict(mel_dim=MEL_DIM, upsample_initial_channel=64, resblock_kernel_sizes=[3, 5],
                   resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5]])
    return Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker,
                             token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan),
                             enable_audio_output=True)


def build_tiny_qwen2_5_omni(path: str | Path, *, seed: int = 0,
                            dit_overrides: dict | None = None) -> Path:
    """Save a tiny random Qwen2.5-Omni checkpoint (float32), its tokenizer and speaker map into
    `path`. Deterministic for a given seed."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_omni_tokenizer(path)
    config = tiny_qwen2_5_omni_config(tokenizer, dit_overrides)
    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(config).float().eval()
    _randomize(model, seed)
    with torch.no_grad():   # the talker's stop codes rarely win, so it speaks for a while
        model.talker.codec_head.weight[[CODEC_PAD, CODEC_EOS]] *= 0.2
    speakers = random_speakers(config, tokenizer, seed + 1)
    make_audible(model.token2wav, speakers[SPEAKERS[0]], seed)
    model.save_pretrained(str(path), safe_serialization=True)
    torch.save(speakers, path / "spk_dict.pt")
    save_tiny_omni_processor(path, tokenizer)
    return path


def random_speakers(config: Any, tokenizer: Any, seed: int) -> dict[str, dict]:
    """A speaker map as spk_dict.pt holds it: per name, the text bos id (the tts bos token
    here), a conditioning vector and a 12-frame reference mel, drawn at random."""
    gen = torch.Generator().manual_seed(seed)
    dit = config.token2wav_config.dit_config
    return {name: {"bos_token": tokenizer.convert_tokens_to_ids("<|tts_bos|>"),
                   "cond": torch.randn(1, dit.enc_emb_dim, generator=gen),
                   "ref_mel": torch.randn(1, 12, dit.mel_dim, generator=gen)}
            for name in SPEAKERS}


@torch.no_grad()
def make_audible(token2wav: torch.nn.Module, speaker: dict, seed: int, peak: float = 0.5) -> None:
    """Rescale four outputs of the random token2wav to the sizes the trained one works at:
    the speaker encoder's vector and the time embedding to unit spread (random convolutions
    and MLPs leave them in the hundreds of thousands and hundreds, which drowns the DiT's
    attention in its residual stream), the velocity to unit spread (a mel where a log mel
    sits, not one the vocoder clamps flat), and BigVGAN's last conv to a waveform peaking near
    `peak` (not clamped at +-1). Otherwise no error in between would change the output."""
    dit, vocoder = token2wav.code2wav_dit_model, token2wav.code2wav_bigvgan_model
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, NUM_CODES, (1, 10), generator=gen)
    x = torch.randn(1, 10 * dit.repeats, MEL_DIM, generator=gen)
    spread = dit.input_embed.spk_encoder(speaker["ref_mel"]).std().item()
    _scale(dit.input_embed.spk_encoder.fc, 1.0 / spread)
    temb = dit.time_embed(torch.rand(8, generator=gen))
    _scale(dit.time_embed.time_mlp[2], 1.0 / temb.std().item())
    cond = speaker["cond"].expand(x.shape[1], -1)[None]
    v = dit(hidden_states=x, quantized_code=codes, speaker_embedding=cond,
            condition_vector=speaker["ref_mel"], time_step=torch.tensor(0.5), apply_cfg=False)
    _scale(dit.proj_out, 1.0 / v.std().item())
    seen: list[torch.Tensor] = []
    hook = vocoder.conv_post.register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        torch.manual_seed(seed)
        token2wav(codes, conditioning=speaker["cond"], reference_mel=speaker["ref_mel"])
    finally:
        hook.remove()
    _scale(vocoder.conv_post, peak / seen[0].abs().max().item())


def _scale(layer: torch.nn.Module, factor: float) -> None:
    layer.weight.mul_(factor)
    if layer.bias is not None:
        layer.bias.mul_(factor)


def mask_the_talker(talker: torch.nn.Module):
    """transformers 5.24's generate() no longer hands the talker's forward its attention mask,
    and without one the forward skips what the released model does with it (the codec pad and
    bos added to the prompt's last two rows, M-RoPE positions of the prompt): give every call
    an all-ones mask of the sequence so far, as the 4.x loop did. Returns the hook's handle."""
    seen = {"len": 0}

    def pre_hook(_module, args, kwargs):
        embeds = kwargs.get("inputs_embeds")
        seen["len"] = embeds.shape[1] if embeds is not None else seen["len"] + 1
        kwargs["attention_mask"] = torch.ones(1, seen["len"], dtype=torch.long,
                                              device=next(talker.parameters()).device)
        return args, kwargs

    return talker.register_forward_pre_hook(pre_hook, with_kwargs=True)
