"""Chat messages -> thinker inputs, against transformers on the tiny random checkpoint:
token ids, audio features and pixels equal to what `Qwen3OmniMoeProcessor` makes of the same
prompt, positions equal to HF's `get_rope_index`, and HF's thinker `forward` run on our inputs
merging the same embeddings as our encoders plus `merge_multimodal_embeddings`."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from PIL import Image
from safetensors import safe_open

from omnistage.models.qwen3_omni.audio_encoder import AudioEncoder
from omnistage.models.audio_parts import load_audio, resample
from omnistage.models.qwen3_omni.mrope import mrope_positions
from omnistage.models.qwen3_omni.multimodal import merge_multimodal_embeddings
from omnistage.models.qwen3_omni.processing import InputProcessor
from omnistage.models.qwen3_omni.vision_encoder import VisionEncoder
from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

ATOL = 1e-4


def build_checkpoint(path: Path) -> Path:
    """The tiny checkpoint with the released audio chunking (n_window=50; HF's token count
    hardcodes 13 tokens per 100-frame chunk) and 2-chunk attention windows. Weights do not
    depend on either."""
    build_tiny_qwen3_omni(path)
    config = json.loads((path / "config.json").read_text())
    config["thinker_config"]["audio_config"].update(n_window=50, n_window_infer=200)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="module")
def omni_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("omni"))


@pytest.fixture(scope="module")
def processor(omni_path: Path) -> InputProcessor:
    return InputProcessor.from_pretrained(omni_path, max_image_pixels=200 * 200)


@pytest.fixture(scope="module")
def hf_thinker(omni_path: Path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(omni_path, dtype=torch.float32)
    return model.thinker.eval()


@pytest.fixture(scope="module")
def hf_processor(omni_path: Path, processor: InputProcessor):
    """transformers' own processor for text, audio and images. Its constructor insists on a
    torchvision video processor, which we do not install: skip that class check."""
    from transformers import Qwen3OmniMoeProcessor
    from transformers.processing_utils import ProcessorMixin

    tokenizer = processor.tokenizer
    for attr, token in (("audio_token", "<|audio_pad|>"), ("image_token", "<|image_pad|>"),
                        ("video_token", "<|video_pad|>"), ("vision_bos_token", "<|vision_start|>"),
                        ("vision_eos_token", "<|vision_end|>"),
                        ("audio_bos_token", "<|audio_start|>"),
                        ("audio_eos_token", "<|audio_end|>")):
        setattr(tokenizer, attr, token)
        setattr(tokenizer, attr + "_id", tokenizer.convert_tokens_to_ids(token))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda *args: None)
        return Qwen3OmniMoeProcessor(image_processor=processor.image_processor,
                                     video_processor=None,
                                     feature_extractor=processor.feature_extractor,
                                     tokenizer=tokenizer)


def wave(seconds: float, sr: int = 16000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(seconds * sr))).astype(np.float32)


def image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def png_bytes(img: Image.Image) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return buffer.getvalue()


def mixed_messages() -> list[dict]:
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [
            {"type": "audio", "audio": (wave(2.73), 16000)},
            {"type": "text", "text": "What is this? And these:"},
            {"type": "image", "image": image(30, 20)},
            {"type": "audio", "audio": wave(0.31, seed=1), "sample_rate": 16000},
            {"type": "image", "image": image(41, 57, seed=2)},
        ]},
    ]


def test_matches_hf_processor(processor: InputProcessor, hf_processor) -> None:
    messages = mixed_messages()
    ours = processor(messages)
    user = messages[1]["content"]
    ref = hf_processor(text=[ours.prompt], audio=[user[0]["audio"][0], user[3]["audio"]],
                       images=[user[2]["image"], user[4]["image"]], return_tensors="pt",
                       n_window=processor.n_window)
    assert torch.equal(ours.input_ids, ref["input_ids"][0])
    mask = ref["feature_attention_mask"].bool()
    assert torch.equal(ours.audio_feature_lens, mask.sum(-1))
    torch.testing.assert_close(ours.input_features,
                               ref["input_features"].permute(0, 2, 1)[mask].T, atol=0, rtol=0)
    torch.testing.assert_close(ours.pixel_values, ref["pixel_values"], atol=0, rtol=0)
    assert torch.equal(ours.image_grid_thw, ref["image_grid_thw"])
    # placeholder counts: 2.73 s -> 273 frames -> 2 chunks (26) + 73 frames (10) = 36 tokens
    t = processor.tokens
    audio_runs = [36, 4]
    assert int((ours.input_ids == t.audio_pad).sum()) == sum(audio_runs)
    assert int((ours.input_ids == t.image_pad).sum()) == int(
        (ours.image_grid_thw.prod(-1) // 4).sum())


def video_frames(n: int, width: int = 24, height: int = 16) -> list[Image.Image]:
    return [image(width, height, seed=10 + k) for k in range(n)]


PROMPTS = {
    "text": [{"role": "user", "content": "Hello world"}],
    "audio": [{"role": "user", "content": [{"type": "audio", "audio": (wave(1.5), 16000)},
                                           {"type": "text", "text": "Describe it."}]}],
    "image": [{"role": "user", "content": [{"type": "image", "image": image(40, 24)},
                                           {"type": "text", "text": "What is this?"}]}],
    "mixed": mixed_messages(),
    "video": [{"role": "user", "content": [
        {"type": "video", "video": video_frames(5), "fps": 2.0},
        {"type": "image", "image": image(16, 16)},
        {"type": "audio", "audio": (wave(0.8), 16000)},
        {"type": "text", "text": "Same place?"}]}],
}


@pytest.mark.parametrize("name", PROMPTS)
def test_positions_match_hf_get_rope_index(processor: InputProcessor, hf_thinker,
                                           name: str) -> None:
    ours = processor(PROMPTS[name])
    ref_pos, ref_delta = hf_thinker.model.get_rope_index(
        ours.input_ids[None], image_grid_thw=ours.image_grid_thw,
        video_grid_thw=ours.video_grid_thw, attention_mask=torch.ones_like(ours.input_ids)[None],
        audio_seqlens=ours.audio_feature_lens, second_per_grids=ours.video_second_per_grid)
    assert ours.positions.dtype == torch.long
    assert torch.equal(ours.positions, ref_pos[:, 0].long())
    assert ours.rope_delta == int(ref_delta)
    if name == "text":
        assert torch.equal(ours.positions[0], torch.arange(len(ours.input_ids)))


def test_thinker_forward_on_our_inputs(omni_path: Path, processor: InputProcessor,
                                       hf_thinker) -> None:
    """HF's thinker runs on our inputs (audio, two images, a video), and the embeddings,
    deepstack features and positions it hands its language model equal ours."""
    inputs = processor(PROMPTS["mixed"][:1] + [{"role": "user", "content": [
        *PROMPTS["mixed"][1]["content"], {"type": "video", "video": video_frames(4), "fps": 1.0}]}])
    captured = {}

    def grab(module, args, kwargs):
        captured.update(kwargs)
    handle = hf_thinker.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            logits = hf_thinker(**inputs.hf_kwargs()).logits
    finally:
        handle.remove()
    assert logits.shape == (1, len(inputs.input_ids), hf_thinker.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()

    with safe_open(omni_path / "model.safetensors", "pt") as f:
        table = f.get_tensor("thinker.model.embed_tokens.weight")
    audio = AudioEncoder.from_pretrained(omni_path)
    vision = VisionEncoder.from_pretrained(omni_path)
    with torch.no_grad():
        audio_embeds = audio(inputs.input_features, inputs.audio_feature_lens)
        image_embeds, image_deepstack = vision(inputs.pixel_values, inputs.image_grid_thw)
        video_embeds, video_deepstack = vision(inputs.pixel_values_videos, inputs.video_grid_thw)
    merged = merge_multimodal_embeddings(
        inputs.input_ids, table[inputs.input_ids], processor.tokens, audio_embeds=audio_embeds,
        image_embeds=image_embeds, video_embeds=video_embeds, image_deepstack=image_deepstack,
        video_deepstack=video_deepstack)

    torch.testing.assert_close(merged.inputs_embeds, captured["inputs_embeds"][0],
                               atol=ATOL, rtol=0)
    assert torch.equal(merged.visual_mask, captured["visual_pos_masks"][0])
    assert len(merged.deepstack) == len(captured["deepstack_visual_embeds"]) == 2
    for got, want in zip(merged.deepstack, captured["deepstack_visual_embeds"]):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert torch.equal(inputs.positions, captured["position_ids"][:, 0].long())
    rows, features = merged.deepstack_rows(offset=3)        # the thinker's deepstack argument
    assert torch.equal(rows, captured["visual_pos_masks"][0].nonzero().squeeze(1) + 3)
    assert torch.equal(features, torch.stack(merged.deepstack))


def test_merge_checks_counts(processor: InputProcessor) -> None:
    inputs = processor(PROMPTS["image"])
    n = int((inputs.input_ids == processor.tokens.image_pad).sum())
    embeds = torch.zeros(len(inputs.input_ids), 64)
    with pytest.raises(ValueError, match=f"image: {n} placeholder tokens but {n - 1}"):
        merge_multimodal_embeddings(inputs.input_ids, embeds, processor.tokens,
                                    image_embeds=torch.zeros(n - 1, 64))
    with pytest.raises(ValueError, match="no image embeddings"):
        merge_multimodal_embeddings(inputs.input_ids, embeds, processor.tokens)


def test_video_layout(processor: InputProcessor) -> None:
    """A video of `temporal_patch_size` copies of one frame is that image; 5 frames make 3
    temporal patches (the last frame repeated), each frame's pixels in its temporal slot."""
    frame = image(24, 16)
    still = processor([{"role": "user", "content": [{"type": "image", "image": frame}]}])
    video = processor([{"role": "user", "content": [{"type": "video", "video": [frame, frame]}]}])
    assert torch.equal(video.pixel_values_videos, still.pixel_values)
    assert torch.equal(video.video_grid_thw, still.image_grid_thw)
    assert video.video_second_per_grid.tolist() == [1.0]          # 2 frames / 2 fps

    frames = video_frames(5)
    inputs = processor([{"role": "user", "content": [{"type": "video", "video": frames}]}])
    assert inputs.video_grid_thw.tolist() == [[3, 4, 6]]
    pixels = inputs.pixel_values_videos.view(3, 24, 3, 2, 4, 4)   # (t, hw, C, tp, p, p)
    singles = [processor([{"role": "user", "content": [{"type": "image", "image": f}]}])
               .pixel_values.view(24, 3, 2, 4, 4)[:, :, 0] for f in frames]
    for k, single in enumerate(singles + [singles[-1]]):
        assert torch.equal(pixels[k // 2, :, :, k % 2], single)


def test_resample_keeps_a_tone() -> None:
    for orig in (8000, 22050, 44100, 48000):
        t = np.arange(int(0.5 * orig)) / orig
        tone = np.sin(2 * np.pi * 440.0 * t).astype(np.float32)
        out = resample(tone, orig, 16000)
        assert out.shape == (int(np.ceil(len(tone) * 16000 / orig)),)
        expected = np.sin(2 * np.pi * 440.0 * np.arange(len(out)) / 16000)
        inner = slice(200, -200)                                  # away from the edges
        assert np.abs(out[inner] - expected[inner]).max() < 2e-3, orig
    # content above the new Nyquist frequency is removed, not folded back
    t = np.arange(44100) / 44100
    high = np.sin(2 * np.pi * 12000.0 * t).astype(np.float32)
    assert np.abs(resample(high, 44100, 16000)[200:-200]).max() < 1e-2


def test_processor_resamples(processor: InputProcessor) -> None:
    w8k = wave(1.0, sr=8000)
    a = processor([{"role": "user", "content": [{"type": "audio", "audio": (w8k, 8000)}]}])
    b = processor([{"role": "user", "content": [
        {"type": "audio", "audio": (resample(w8k, 8000, 16000), 16000)}]}])
    assert torch.equal(a.input_features, b.input_features)
    assert torch.equal(a.audio_feature_lens, torch.tensor([100]))


def test_load_audio_and_bytes_parts(processor: InputProcessor) -> None:
    stereo = np.stack([wave(0.5, 22050), wave(0.5, 22050, seed=3)], axis=1)
    buffer = io.BytesIO()
    soundfile.write(buffer, stereo, 22050, format="WAV", subtype="FLOAT")
    waveform, sr = load_audio(buffer.getvalue())
    assert sr == 22050 and waveform.dtype == np.float32
    np.testing.assert_allclose(waveform, stereo.mean(axis=1), atol=1e-6)
    from_bytes = processor([{"role": "user", "content": [
        {"type": "audio", "audio": buffer.getvalue()}]}])
    from_wave = processor([{"role": "user", "content": [
        {"type": "audio", "audio": (waveform, sr)}]}])
    assert torch.equal(from_bytes.input_features, from_wave.input_features)

    with pytest.raises(ValueError, match="cannot decode 11 bytes as an audio file"):
        load_audio(b"not a file!")
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\].audio: cannot decode"):
        processor([{"role": "user", "content": [{"type": "audio", "audio": b"RIFF...."}]}])

    decoded = processor([{"role": "user", "content": [
        {"type": "image", "image": png_bytes(image(20, 12))}]}])
    direct = processor([{"role": "user", "content": [{"type": "image", "image": image(20, 12)}]}])
    assert torch.equal(decoded.pixel_values, direct.pixel_values)


@pytest.mark.parametrize("part, match", [
    ({"type": "audio", "audio": (np.zeros(0, np.float32), 16000)}, r"content\[0\].audio: empty"),
    ({"type": "audio", "audio": (np.zeros(100, np.float32), 16000)}, "too short"),
    ({"type": "audio", "audio": np.zeros(16000, np.float32)}, "sample_rate: needed"),
    ({"type": "audio", "audio": (np.zeros((2, 16000), np.float32), 16000)}, "1-D"),
    ({"type": "audio", "audio": (np.full(800, np.nan, np.float32), 16000)}, "NaN"),
    ({"type": "image", "image": "cat.png"}, r"content\[0\].image: expected a PIL image"),
    ({"type": "image", "image": b"\x89PNG garbage"}, "cannot decode 12 bytes as an image"),
    ({"type": "image", "image": Image.new("RGB", (300, 200))}, "image too large"),
    ({"type": "image", "image": Image.new("RGB", (1, 250))}, "aspect ratio"),
    ({"type": "image", "image": png_bytes(Image.new("RGB", (300, 200)))}, "image too large"),
    ({"type": "video", "video": []}, "non-empty list"),
    ({"type": "video", "video": [Image.new("RGB", (8, 8)), Image.new("RGB", (16, 8))]},
     "same size"),
    ({"type": "input_audio"}, r"content\[0\].type"),
])
def test_rejects_bad_parts(processor: InputProcessor, part: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        processor([{"role": "user", "content": [part]}])


def test_rejects_placeholders_in_text(processor: InputProcessor) -> None:
    with pytest.raises(ValueError, match="1 <\\|audio_pad\\|> placeholders for 0 audio"):
        processor([{"role": "user", "content": "say <|audio_start|><|audio_pad|><|audio_end|>"}])
    with pytest.raises(ValueError, match="must stand alone"):
        processor.process("<|im_start|>user\n<|audio_pad|>", audios=[wave(1.0)])


def test_mrope_positions_checks_grids(processor: InputProcessor) -> None:
    t = processor.tokens
    ids = [5, t.vision_start] + [t.image_pad] * 6 + [t.vision_end, 7]
    positions, delta = mrope_positions(
        ids, image_token_id=t.image_pad, video_token_id=t.video_pad, spatial_merge_size=2,
        position_id_per_seconds=25, image_grid_thw=torch.tensor([[1, 4, 6]]))
    assert positions.tolist() == [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
                                  [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
                                  [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]]
    assert delta == 7 - 10
    with pytest.raises(ValueError, match="image 0 has 6 placeholder tokens, its grid"):
        mrope_positions(ids, image_token_id=t.image_pad, video_token_id=t.video_pad,
                        spatial_merge_size=2, position_id_per_seconds=25,
                        image_grid_thw=torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="1 image placeholder runs for 2 image grids"):
        mrope_positions(ids, image_token_id=t.image_pad, video_token_id=t.video_pad,
                        spatial_merge_size=2, position_id_per_seconds=25,
                        image_grid_thw=torch.tensor([[1, 4, 6], [1, 2, 2]]))
