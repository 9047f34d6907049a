"""Qwen2.5-Omni (thinker -> talker -> token2wav) on our stage runtime against transformers'
`generate(return_audio=True)`, on a random-weight checkpoint built in the run: the method of
omni.py (the reference one request at a time, its waveform whole; ours the default graph at
each concurrency), this model's checkpoint and reference call.

Both sides: greedy thinker and talker (repetition penalty 1.05), exactly `thinker_tokens`
text tokens and `talker_tokens` codec tokens (eos ignored / min new tokens), the default
speaker (Chelsie), token2wav at the reference's 10 ODE points with guidance, text prompts.

Sizes ("bench"): Qwen2.5-Omni-7B's thinker at its width (hidden 3584, 28 heads, 4 KV heads,
MLP 18944) with 8 of its 28 layers; its talker (24 layers of 896, embedding 3584) and
token2wav (DiT 22 layers of 1024, BigVGAN from 1536 channels, 80 mel bins) at their real
sizes; vocabulary the tiny test tokenizer's; transformers' own init. "real": the thinker's
28 layers and 152k vocabulary. "tiny": the test checkpoint (tiny_qwen2_5_omni.py).
Note: transformers 5.24's talker forward receives no attention mask from generate(), so its
prompt lacks the codec pad / bos rows ours has (tiny_qwen2_5_omni.mask_the_talker): the same
amount of work, so the timing stands.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from omnistage.benchmarks.common import (
    default_dtype,
    environment,
    free_device_memory,
    now,
    parameter_bytes,
)
from omnistage.benchmarks.omni import (
    SAMPLE_RATE,
    OmniBenchConfig,
    _prompt,
    audio_ratios,
    bench_ours,
    one_at_a_time,
)
from omnistage.utils.device import resolve_device

BENCH_SIZES = {
    "thinker_text": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=8,
                         num_attention_heads=28, num_key_value_heads=4,
                         max_position_embeddings=32768,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [16, 24, 24]}),
    "audio": dict(output_dim=3584),
    "vision": dict(out_hidden_size=3584),
    # codec: 8448 ids, the specials at the real model's 8292..8296
    "talker": dict(vocab_size=8448, embedding_size=3584, hidden_size=896,
                   intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                   num_key_value_heads=2, head_dim=64, max_position_embeddings=32768,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                    "mrope_section": [16, 8, 8]},
                   tts_codec_start_token_id=8293, tts_codec_end_token_id=8294,
                   tts_codec_pad_token_id=8292, tts_codec_mask_token_id=8296),
    # the transformers defaults (the released sizes), every codec id embeddable
    "dit": dict(hidden_size=1024, num_hidden_layers=22, num_attention_heads=16, head_dim=64,
                emb_dim=512, block_size=24, look_ahead_layers=[10],
                look_backward_layers=[0, 20], num_embeds=8448, mel_dim=80, enc_emb_dim=192,
                enc_dim=128, enc_channels=[256, 256, 256, 256, 768],
                enc_attention_channels=64, enc_se_channels=64),
    "bigvgan": dict(mel_dim=80, upsample_initial_channel=1536,
                    resblock_kernel_sizes=[3, 7, 11],
                    resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]]),
}
REAL_SIZES = {"thinker_text": dict(num_hidden_layers=28, vocab_size=152064)}
TALKER_EOS = (8292, 8294)      # the reference's talker_eos_token_id at these sizes


def bench_config(tokenizer, real: bool = False):
    """tiny_qwen2_5_omni's config (token ids, structure) with BENCH_SIZES (and REAL_SIZES)."""
    from transformers import Qwen2_5OmniConfig

    from omnistage.testing.tiny_qwen2_5_omni import tiny_qwen2_5_omni_config

    raw = tiny_qwen2_5_omni_config(tokenizer).to_dict()
    thinker, t2w = raw["thinker_config"], raw["token2wav_config"]
    thinker["text_config"].update(BENCH_SIZES["thinker_text"])
    if real:
        thinker["text_config"].update(REAL_SIZES["thinker_text"])
    thinker["text_config"].pop("layer_types", None)        # derived from the layer count
    thinker["audio_config"].update(BENCH_SIZES["audio"])
    thinker["vision_config"].update(BENCH_SIZES["vision"])
    raw["talker_config"].update(BENCH_SIZES["talker"])
    raw["talker_config"].pop("layer_types", None)
    t2w["dit_config"].update(BENCH_SIZES["dit"])
    t2w["bigvgan_config"].update(BENCH_SIZES["bigvgan"])
    return Qwen2_5OmniConfig(**{k: v for k, v in raw.items()
                                if k not in ("architectures", "transformers_version")})


def build_checkpoint(sizes: str, path: Path, device: torch.device, dtype: torch.dtype):
    """Save a random Qwen2.5-Omni checkpoint (+ tokenizer, speaker map) to `path`; return the
    transformers model on `device` in `dtype` (its token2wav in float32, as its generate()
    makes it)."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    from omnistage.testing.tiny_omni import build_tiny_omni_tokenizer, save_tiny_omni_processor
    from omnistage.testing.tiny_qwen2_5_omni import build_tiny_qwen2_5_omni, random_speakers

    if sizes == "tiny":     # the test checkpoint, weights drawn so every path matters
        build_tiny_qwen2_5_omni(path)
        model = Qwen2_5OmniForConditionalGeneration.from_pretrained(str(path), dtype=dtype)
        return model.to(device).eval()
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_omni_tokenizer(path)
    config = bench_config(tokenizer, real=sizes == "real")
    torch.manual_seed(0)
    with torch.device(device), default_dtype(dtype):     # transformers' init, in seconds
        model = Qwen2_5OmniForConditionalGeneration(config).eval()
    model.config.dtype = dtype
    model.save_pretrained(str(path), safe_serialization=True)
    torch.save(random_speakers(config, tokenizer, 1), path / "spk_dict.pt")
    save_tiny_omni_processor(path, tokenizer)   # its media settings unused: text prompts
    model.load_speakers(str(path / "spk_dict.pt"))
    return model


def bench_transformers(model, path: Path, cfg: OmniBenchConfig, device: torch.device
                       ) -> dict[str, object]:
    from transformers import AutoTokenizer

    from omnistage.testing.tiny_qwen2_5_omni import CODEC_EOS, CODEC_PAD

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    talker_eos = [CODEC_PAD, CODEC_EOS] if cfg.sizes == "tiny" else list(TALKER_EOS)

    def one(i: int) -> tuple[float, int, int]:
        text = tokenizer.apply_chat_template(_prompt(i)["messages"], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
        t0 = now(device)
        with torch.no_grad():
            seq, wav = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), thinker_do_sample=False,
                thinker_max_new_tokens=cfg.thinker_tokens,
                thinker_min_new_tokens=cfg.thinker_tokens, thinker_eos_token_id=eos,
                talker_do_sample=False, talker_max_new_tokens=cfg.talker_tokens,
                talker_min_new_tokens=cfg.talker_tokens, talker_eos_token_id=talker_eos)
        return now(device) - t0, seq.shape[1] - ids.shape[1], wav.numel()

    one(0)                                                    # warm-up, at full length
    runs = [one(i) for i in range(cfg.reference_requests)]
    return {**one_at_a_time([r[0] for r in runs], [r[2] / SAMPLE_RATE for r in runs],
                            cfg.concurrency), "text_tokens": [r[1] for r in runs]}


def decode_codes(generator, codes: torch.Tensor, per_call: int = 25) -> torch.Tensor:
    """One request's codes (speaker 0) fed `per_call` a call, as the talker streams them,
    stepped until the generator holds nothing back: the waveform."""
    from omnistage.payloads import AudioChunk, CodecFrames

    state: dict = {}
    fed, pieces = 0, []
    with torch.inference_mode():
        for _ in range(10 * codes.numel()):
            x = codes[fed:fed + per_call]
            fed += x.numel()
            inputs = CodecFrames(x, speaker=torch.zeros_like(x)).pack() if x.numel() else {}
            (out,) = generator.generate([inputs], [state], [fed >= codes.numel()])
            chunk = AudioChunk.unpack(out)
            if chunk is not None and chunk.samples is not None:
                pieces.append(chunk.samples.float().cpu())
            if fed >= codes.numel() and not generator.has_backlog(state):
                return torch.cat(pieces)
    raise RuntimeError("token2wav did not finish")


def token2wav_options(overrides: list[str] | tuple[str, ...]):
    """The token2wav options the bench's `--stage-override`s give its stage
    (`token2wav.generation.options.KEY=VALUE`, VALUE YAML), read as the stage reads them."""
    from omnistage.configs.options import read_options
    from omnistage.configs.parse import load_yaml
    from omnistage.generation.token2wav import Token2WavOptions

    prefix, data = "token2wav.generation.options.", {}
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip().startswith(prefix):
            data[key.strip().removeprefix(prefix)] = load_yaml(value, key)
    return read_options(Token2WavOptions, data, "stage 'token2wav': generation.options")


def waveform_error(path: Path, device: torch.device, num_codes: int = 300,
                   overrides: tuple[str, ...] = ()) -> dict[str, object]:
    """token2wav's streamed waveform as the bench's stage ran it (`overrides`: its DiT in
    bfloat16 unless they name a dit_dtype, quantized as they say) against float32 and
    unquantized (the reference's precision), the same codes and noise: SNR in dB
    (`omni25_waveform_snr_db`), and the reference's RMS so that a silent output cannot pass."""
    from dataclasses import replace

    from omnistage.generation.token2wav import Token2WavGenerator

    ran = token2wav_options(overrides)
    ran = replace(ran, dit_dtype="bfloat16") if ran.dit_dtype == "auto" else ran
    # the reference uncompiled: float32 rounding apart the same, one compile less a run
    variants = {"reference": replace(ran, dit_dtype="float32", dit_quantization="none",
                                     compile=False), "ran": ran}
    audio, codes = {}, None
    for name, options in variants.items():
        generator = Token2WavGenerator.from_pretrained(path, "", device, None, options)
        if codes is None:
            codes = torch.randint(0, generator.model.cfg.dit.num_embeds, (num_codes,),
                                  generator=torch.Generator().manual_seed(7)).to(device)
        audio[name] = decode_codes(generator, codes)
        del generator
        free_device_memory(device)
    ref, err = audio["reference"], audio["ran"] - audio["reference"]
    return {"omni25_waveform_snr_db": round(10 * math.log10(ref.pow(2).sum().item()
                                                            / max(err.pow(2).sum().item(), 1e-30)), 2),
            "dit_dtype": ran.dit_dtype, "dit_quantization": ran.dit_quantization,
            "reference_rms": ref.pow(2).mean().sqrt().item(),
            "max_abs_error": err.abs().max().item(), "samples": ref.numel(),
            "codes": num_codes}


def headline(ours: dict[str, object], snr: dict[str, object] | None) -> dict[str, object]:
    """The issue's figures (issue 41): real-time factor at 1 / 8 / 32 and first audio at 1 / 8
    (means), the bfloat16 DiT's waveform SNR where measured."""
    by_c = ours["by_concurrency"]
    out: dict[str, object] = {}
    for c in (1, 8, 32):
        if c in by_c or str(c) in by_c:
            row = by_c.get(c, by_c.get(str(c)))
            out[f"omni25_rtf_c{c}"] = row["rtf"]["mean"]
            if c in (1, 8):
                out[f"omni25_first_audio_s_c{c}"] = row["first_audio_s"]["mean"]
    if snr is not None:
        out["omni25_waveform_snr_db"] = snr["omni25_waveform_snr_db"]
    return out


def run(cfg: OmniBenchConfig) -> dict[str, object]:
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-omni25-") as tmp:
        path = Path(tmp) / "qwen2.5-omni"
        model = build_checkpoint(cfg.sizes, path, device, dtype)
        params = {part: parameter_bytes(getattr(model, part)) // model.dtype.itemsize
                  for part in ("thinker", "talker")}
        params["token2wav"] = parameter_bytes(model.token2wav) // 4           # float32
        hf = bench_transformers(model, path, cfg, device) if cfg.reference_requests else None
        del model
        free_device_memory(device)
        ours = bench_ours(path, cfg, device, dtype, overrides=list(cfg.stage_overrides))
        free_device_memory(device)
        snr = waveform_error(path, device, overrides=cfg.stage_overrides) \
            if cfg.sizes != "tiny" else None
    ratios = audio_ratios(ours["by_concurrency"], hf, cfg.concurrency, "transformers")
    return {
        "benchmark": "omni", "model": "qwen2.5-omni", **environment(device),
        "dtype": str(dtype).removeprefix("torch."),
        "config": {**asdict(cfg), "sizes_changed": "omnistage.testing.tiny_qwen2_5_omni"
                   if cfg.sizes == "tiny" else BENCH_SIZES,
                   "real_sizes": REAL_SIZES if cfg.sizes == "real" else None,
                   "parameters": params},
        "headline": headline(ours, snr), "waveform_error": snr,
        "reference": hf, "omnistage": ours, "ratios": ratios,
        "notes": "reference: transformers' generate(return_audio=True). first_audio: "
                 "seconds from submission to the first audio chunk (the reference returns the "
                 "waveform whole; ours streams token2wav by the default graph's chunking, or "
                 "decodes whole with token2wav.generation.options.chunk_blocks=0). rtf: end-to-end "
                 "seconds per second of audio. transformers at concurrency c: requests run "
                 "one by one, makespan and mean latency estimated from the measured time.",
    }
