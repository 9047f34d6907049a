"""Chat request -> Qwen3-Omni thinker inputs, without transformers' `Qwen3OmniMoeProcessor`
(it needs torchvision): transformers' WhisperFeatureExtractor and PIL Qwen2-VL image processor
built from the checkpoint's preprocessor_config.json, plus our own placeholder expansion and
multimodal rotary positions.

    messages -> text with one placeholder per item, through the tokenizer's chat template:
        "<|im_start|>user\\n<|audio_start|><|audio_pad|><|audio_end|>What is ...<|im_end|>..."
    tokenize, then repeat every placeholder to its encoder's token count:
        <|audio_pad|> x output_lengths(mel frames)    between <|audio_start|> .. <|audio_end|>
        <|image_pad|> x t*h*w / merge^2               between <|vision_start|> .. <|vision_end|>
        <|video_pad|> x t*h*w / merge^2               between <|vision_start|> .. <|vision_end|>
    mrope_positions(ids) -> (3, L) positions: text and audio count up on all three axes; an
        image / video block gets (t, row, col) offsets from where it starts, and the text after
        it resumes at the block's largest position + 1.

Like the reference processor, all audios of one request go through the feature extractor in
one call (padded to the longest). n_window comes from the model config (the reference
processor has its own default, 50, the released value). Videos are frames the caller already
sampled, given with their fps; each frame goes through the image processor and
`temporal_patch_size` consecutive frames form one temporal patch (the layout of transformers'
Qwen2-VL video processor; its torchvision resize is not reproduced bit for bit).

A video part may bring its audio track (`"audio"` in the part: Qwen-Omni's
`use_audio_in_video`). The track is one more audio of the request, in the order of the parts,
and the video's placeholder becomes one block of both, ordered by time (audio_in_video.py):

    <|vision_start|><|audio_start|> video and audio tokens <|audio_end|><|vision_end|>

Audio at another sample rate is resampled to the feature extractor's (16 kHz) by
models/audio_parts.py. The positions are mrope.py's; the inputs' records and the merge of
encoder outputs into the embeddings, multimodal.py's.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from omnistage.models.qwen3_omni.audio_encoder import output_lengths, read_thinker_config
from omnistage.models.qwen3_omni.audio_in_video import merge_by_time, video_token_times
from omnistage.models.audio_parts import part_waveform
from omnistage.models.qwen3_omni.mrope import mrope_positions
from omnistage.models.qwen3_omni.multimodal import SpecialTokens, ThinkerInputs

DEFAULT_MAX_IMAGE_PIXELS = 1 << 25      # 33.5 M: an 8K UHD frame (7680 x 4320) still fits
DEFAULT_VIDEO_FPS = 2.0


# ---- the processor -------------------------------------------------------------------------------

class InputProcessor:
    """`processor(messages) -> ThinkerInputs` for OpenAI-like chat messages whose content is a
    string or a list of parts:

        {"type": "text", "text": str}
        {"type": "audio", "audio": (waveform, sample_rate) | bytes of an audio file}
            (or "audio": waveform with "sample_rate": int; waveform 1-D float, any rate)
        {"type": "image", "image": PIL.Image.Image | bytes of an image file}
        {"type": "video", "video": [PIL.Image.Image, ...], "fps": float (default 2),
         "audio": its audio track as an audio part's "audio" (optional)}
    """

    input_modalities = ("text", "audio", "image", "video")   # the part types above
    # what differs between the Qwen-Omni generations' reference processors (Qwen2.5-Omni's
    # subclass, qwen2_5_omni/processing.py, sets its own)
    audio_padding: bool | str = True        # the feature extractor's: to the longest audio
    truncate_time = False                   # video time positions: whole steps only
    shared_brackets = False                 # audio in video: every bracket token its position

    def audio_tokens(self, feature_lens: Tensor) -> Tensor:
        """Encoder tokens of audios of `feature_lens` mel frames."""
        return output_lengths(feature_lens, self.n_window)

    def interleave(self, video_times: list[float], num_audio: int) -> list[tuple[bool, int]]:
        """An audio-in-video block's runs (is_video, count): the reference processor's
        order of a video's tokens (their times in positions) and its audio's."""
        return merge_by_time(video_times, num_audio)

    @staticmethod
    def special_tokens(thinker_config, tokenizer) -> SpecialTokens:
        return SpecialTokens.from_hf(thinker_config, tokenizer)

    def __init__(self, tokenizer, feature_extractor, image_processor, tokens: SpecialTokens, *,
                 n_window: int, spatial_merge_size: int, position_id_per_seconds: float,
                 max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        self.tokenizer = tokenizer
        self.feature_extractor = feature_extractor
        self.image_processor = image_processor
        self.tokens = tokens
        self.n_window = n_window
        self.spatial_merge_size = spatial_merge_size
        self.position_id_per_seconds = position_id_per_seconds
        self.max_image_pixels = max_image_pixels
        if image_processor.merge_size != spatial_merge_size:
            raise ValueError(f"preprocessor merge_size {image_processor.merge_size} != vision "
                             f"spatial_merge_size {spatial_merge_size}")
        self.placeholders = {
            "audio": self._token(tokens.audio_start) + self._token(tokens.audio_pad)
            + self._token(tokens.audio_end),
            "image": self._token(tokens.vision_start) + self._token(tokens.image_pad)
            + self._token(tokens.vision_end),
            "video": self._token(tokens.vision_start) + self._token(tokens.video_pad)
            + self._token(tokens.vision_end)}

    @classmethod
    def from_pretrained(cls, path: str | Path, *,
                        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> InputProcessor:
        from transformers import AutoTokenizer, WhisperFeatureExtractor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil)

        path = Path(path)
        if not (path / "preprocessor_config.json").is_file():
            raise FileNotFoundError(f"{path}: no preprocessor_config.json")
        thinker = read_thinker_config(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(tokenizer, WhisperFeatureExtractor.from_pretrained(path),
                   Qwen2VLImageProcessorPil.from_pretrained(path),
                   cls.special_tokens(thinker, tokenizer),
                   n_window=thinker.audio_config.n_window,
                   spatial_merge_size=thinker.vision_config.spatial_merge_size,
                   position_id_per_seconds=thinker.position_id_per_seconds,
                   max_image_pixels=max_image_pixels)

    def _token(self, token_id: int) -> str:
        return self.tokenizer.convert_ids_to_tokens(token_id)

    # -- requests ------------------------------------------------------------------------------

    def __call__(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                 **chat_template_kwargs: Any) -> ThinkerInputs:
        """Render `messages` with the tokenizer's chat template and process them."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: expected a non-empty list of {role, content} dicts")
        conversation = []
        audios: list[np.ndarray] = []
        images: list[Image.Image] = []
        videos: list[tuple[list[Image.Image], float]] = []
        video_audio: list[int | None] = []           # each video's track in `audios`
        for i, message in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"{where}: expected a dict with a string 'role'")
            content = message.get("content")
            if isinstance(content, str):
                conversation.append({"role": message["role"], "content": content})
                continue
            if not isinstance(content, list):
                raise ValueError(f"{where}.content: expected a string or a list of parts")
            text = []
            for j, part in enumerate(content):
                text.append(self._part(part, f"{where}.content[{j}]", audios, images, videos,
                                       video_audio))
            conversation.append({"role": message["role"], "content": "".join(text)})
        prompt = self.tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
            **chat_template_kwargs)
        return self.process(prompt, audios=audios, images=images, videos=videos,
                            video_audio=video_audio)

    def _part(self, part: Any, where: str, audios: list, images: list, videos: list,
              video_audio: list) -> str:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{where}.text: expected a string")
            return part["text"]
        if kind == "audio":
            audios.append(self._audio(part, where))
        elif kind == "image":
            images.append(self._image(part.get("image"), f"{where}.image"))
        elif kind == "video":
            if part.get("audio") is not None:
                video_audio.append(len(audios))
                audios.append(self._audio(part, where))
            elif part.get("use_audio_in_video"):
                raise ValueError(f"{where}.use_audio_in_video: give the video's audio track "
                                 "as the part's audio ((waveform, sample_rate) or file bytes)")
            else:
                video_audio.append(None)
            frames = part.get("video")
            if not isinstance(frames, (list, tuple)) or not frames:
                raise ValueError(f"{where}.video: expected a non-empty list of PIL images")
            fps = float(part.get("fps", DEFAULT_VIDEO_FPS))
            if not fps > 0:
                raise ValueError(f"{where}.fps: must be positive, got {fps}")
            videos.append(([self._image(f, f"{where}.video[{k}]") for k, f in enumerate(frames)],
                           fps))
        else:
            raise ValueError(f"{where}.type: expected 'text', 'audio', 'image' or 'video', got "
                             f"{kind!r}")
        return self.placeholders[kind]

    def _audio(self, part: dict[str, Any], where: str) -> np.ndarray:
        """A part's audio as a mono float32 waveform at the feature extractor's rate."""
        return part_waveform(part, where, self.feature_extractor.sampling_rate,
                             self.feature_extractor.n_fft)

    def _image(self, image: Any, where: str) -> Image.Image:
        encoded = isinstance(image, (bytes, bytearray))
        if encoded:
            try:
                image = Image.open(io.BytesIO(bytes(image)))    # reads the header only
            except (OSError, Image.DecompressionBombError) as e:
                raise ValueError(f"{where}: cannot decode {len(image)} bytes as an image "
                                 f"({e})") from None
        if not isinstance(image, Image.Image):
            raise ValueError(f"{where}: expected a PIL image or image file bytes, got "
                             f"{type(image).__name__}")
        width, height = image.size
        if width * height == 0:
            raise ValueError(f"{where}: empty image ({width}x{height})")
        if width * height > self.max_image_pixels:
            raise ValueError(f"{where}: image too large ({width}x{height} = {width * height} "
                             f"pixels, max_image_pixels is {self.max_image_pixels})")
        if max(width, height) / min(width, height) > 200:
            raise ValueError(f"{where}: aspect ratio of {width}x{height} is over 200")
        if encoded:
            try:
                image.load()                                    # decode after the size check
            except OSError as e:
                raise ValueError(f"{where}: cannot decode the image ({e})") from None
        return image

    def parse_request(self, prompt: str | dict[str, Any]) -> ThinkerInputs:
        """The front door's prompt forms: a string (tokenized as is), {"messages": [...]}
        (chat, parts as in the class docstring), or {"prompt": templated text,
        "multi_modal_data": {"audio": [...], "image": [...], "video": [...]}} with one
        placeholder triple in the text per item, in order."""
        if isinstance(prompt, str):
            return self.process(prompt)
        if not isinstance(prompt, dict):
            raise ValueError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")
        unknown = set(prompt) - {"messages", "prompt", "multi_modal_data"}
        if unknown:
            raise ValueError(f"prompt has unknown keys {sorted(unknown)}; this model takes "
                             "messages, or prompt with multi_modal_data")
        if "messages" in prompt:
            if "prompt" in prompt or "multi_modal_data" in prompt:
                raise ValueError("prompt: give messages, or prompt (+ multi_modal_data), not both")
            return self(prompt["messages"])
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise ValueError("prompt['prompt'] must be a string")
        mm = prompt.get("multi_modal_data") or {}
        if not isinstance(mm, dict) or set(mm) - {"audio", "image", "video"}:
            raise ValueError("multi_modal_data: expected a dict with keys audio, image, video")

        def items(kind: str) -> list:
            value = mm.get(kind) or []
            return list(value) if isinstance(value, list) else [value]

        audios = [self._audio({"audio": a}, f"multi_modal_data.audio[{i}]")
                  for i, a in enumerate(items("audio"))]
        images = [self._image(im, f"multi_modal_data.image[{i}]")
                  for i, im in enumerate(items("image"))]
        videos = []
        for i, frames in enumerate(items("video")):
            if not isinstance(frames, (list, tuple)) or not frames:
                raise ValueError(f"multi_modal_data.video[{i}]: expected a list of PIL images")
            videos.append(([self._image(f, f"multi_modal_data.video[{i}][{k}]")
                            for k, f in enumerate(frames)], DEFAULT_VIDEO_FPS))
        return self.process(text, audios=audios, images=images, videos=videos)

    # -- templated prompts ---------------------------------------------------------------------

    def process(self, prompt: str, audios: Sequence[np.ndarray] = (),
                images: Sequence[Image.Image] = (),
                videos: Sequence[tuple[Sequence[Image.Image], float]] = (),
                video_audio: Sequence[int | None] = ()) -> ThinkerInputs:
        """A templated prompt holding one placeholder triple per item, in order
        ("<|audio_start|><|audio_pad|><|audio_end|>", "<|vision_start|><|image_pad|>
        <|vision_end|>", "...<|video_pad|>..."); audios at the feature extractor's rate.
        `video_audio[k]`: the index in `audios` of video k's track (None: none); a track has
        no placeholder of its own and sits in `audios` where its video is among the parts."""
        tokens = self.tokens
        video_audio = list(video_audio) + [None] * (len(videos) - len(video_audio))
        tracks = {a for a in video_audio if a is not None}
        ids = self.tokenizer(prompt)["input_ids"]
        self._check_placeholders(ids, len(audios) - len(tracks), len(images), len(videos))
        inputs: dict[str, Tensor] = {}
        audio_counts: list[int] = []
        if audios:
            features = self.feature_extractor(
                list(audios), sampling_rate=self.feature_extractor.sampling_rate,
                padding=self.audio_padding, truncation=False, return_attention_mask=True,
                return_tensors="pt")
            lens = features["attention_mask"].sum(-1).long()            # (num_audios,)
            inputs["input_features"] = torch.cat(
                [f[:, :n] for f, n in zip(features["input_features"], lens.tolist())], dim=1)
            inputs["audio_feature_lens"] = lens
            audio_counts = self.audio_tokens(lens).tolist()
        merge2 = self.spatial_merge_size ** 2
        image_counts: list[int] = []
        if images:
            processed = self.image_processor(list(images), return_tensors="pt")
            inputs["pixel_values"] = processed["pixel_values"]
            inputs["image_grid_thw"] = processed["image_grid_thw"]
            image_counts = (processed["image_grid_thw"].prod(-1) // merge2).tolist()
        if videos:
            pixels, grids = zip(*(self._video_patches(frames) for frames, _ in videos))
            tp = self.image_processor.temporal_patch_size
            inputs["pixel_values_videos"] = torch.cat(pixels)
            inputs["video_grid_thw"] = torch.tensor(grids, dtype=torch.long)
            inputs["video_second_per_grid"] = torch.tensor([tp / fps for _, fps in videos])
        input_ids = torch.tensor(self._expand(ids, audio_counts, image_counts, inputs,
                                              video_audio), dtype=torch.long)
        positions, rope_delta = mrope_positions(
            input_ids, image_token_id=tokens.image_pad, video_token_id=tokens.video_pad,
            spatial_merge_size=self.spatial_merge_size,
            position_id_per_seconds=self.position_id_per_seconds,
            image_grid_thw=inputs.get("image_grid_thw"),
            video_grid_thw=inputs.get("video_grid_thw"),
            video_second_per_grid=inputs.get("video_second_per_grid"),
            truncate_time=self.truncate_time, audio_token_id=tokens.audio_pad,
            audio_start_token_id=tokens.audio_start, shared_brackets=self.shared_brackets)
        return ThinkerInputs(input_ids, positions, rope_delta, prompt, **inputs)

    def _expand(self, ids: list[int], audio_counts: list[int], image_counts: list[int],
                inputs: dict[str, Tensor], video_audio: list[int | None]) -> list[int]:
        """Every placeholder repeated to its item's token count; a video with its track
        becomes <|audio_start|> + both, interleaved + <|audio_end|>. The audios' tokens come
        out in the order of `audios` (the order their features are merged in)."""
        t = self.tokens
        tracks = {a for a in video_audio if a is not None}
        standalone = iter(i for i in range(len(audio_counts)) if i not in tracks)
        images, videos = iter(image_counts), iter(range(len(video_audio)))
        order: list[int] = []                    # audio indices in the order they come out
        out: list[int] = []
        for token_id in ids:
            if token_id == t.audio_pad:
                order.append(next(standalone))
                out += [token_id] * audio_counts[order[-1]]
            elif token_id == t.image_pad:
                out += [token_id] * next(images)
            elif token_id == t.video_pad:
                k = next(videos)
                grid = inputs["video_grid_thw"][k]
                if video_audio[k] is None:
                    out += [token_id] * (int(grid.prod()) // self.spatial_merge_size ** 2)
                    continue
                order.append(video_audio[k])
                times = video_token_times(grid.tolist(), self.spatial_merge_size,
                                          float(inputs["video_second_per_grid"][k]),
                                          self.position_id_per_seconds)
                out.append(t.audio_start)
                for is_video, n in self.interleave(times, audio_counts[video_audio[k]]):
                    out += [t.video_pad if is_video else t.audio_pad] * n
                out.append(t.audio_end)
            else:
                out.append(token_id)
        if order != sorted(order):
            raise ValueError(f"audios: a video's track must sit in `audios` where its video is "
                             f"among the media (audio order {order})")
        return out

    def _check_placeholders(self, ids: list[int], num_audios: int, num_images: int,
                            num_videos: int) -> None:
        t = self.tokens
        for name, (start, pad, end), expected in (
                ("audio", (t.audio_start, t.audio_pad, t.audio_end), num_audios),
                ("image", (t.vision_start, t.image_pad, t.vision_end), num_images),
                ("video", (t.vision_start, t.video_pad, t.vision_end), num_videos)):
            where = [i for i, token_id in enumerate(ids) if token_id == pad]
            if len(where) != expected:
                raise ValueError(f"prompt has {len(where)} {self._token(pad)} placeholders for "
                                 f"{expected} {name} inputs (placeholder tokens in the text?)")
            for i in where:
                if i == 0 or i + 1 == len(ids) or ids[i - 1] != start or ids[i + 1] != end:
                    raise ValueError(f"prompt: {self._token(pad)} must stand alone between "
                                     f"{self._token(start)} and {self._token(end)}")

    def _video_patches(self, frames: Sequence[Image.Image]) -> tuple[Tensor, list[int]]:
        """Frames -> (grid_t * grid_h * grid_w, C*tp*p*p) patches and [grid_t, grid_h,
        grid_w]: each frame through the image processor, then `tp` consecutive frames (the last
        repeated to fill) side by side in every patch's temporal slot."""
        sizes = {frame.size for frame in frames}
        if len(sizes) != 1:
            raise ValueError(f"video: all frames must have the same size, got {sorted(sizes)}")
        tp = self.image_processor.temporal_patch_size
        frames = list(frames) + [frames[-1]] * (-len(frames) % tp)
        processed = self.image_processor(frames, return_tensors="pt")
        _, grid_h, grid_w = processed["image_grid_thw"][0].tolist()
        p = self.image_processor.patch_size
        # every frame's patch rows are (C, tp, p, p) with the frame repeated over tp: keep one
        per_frame = processed["pixel_values"].view(len(frames), grid_h * grid_w, -1, tp, p, p)
        per_frame = per_frame[:, :, :, 0]                              # (F, hw, C, p, p)
        grid_t = len(frames) // tp
        patches = per_frame.view(grid_t, tp, grid_h * grid_w, -1, p, p).permute(0, 2, 3, 1, 4, 5)
        return patches.reshape(grid_t * grid_h * grid_w, -1), [grid_t, grid_h, grid_w]
