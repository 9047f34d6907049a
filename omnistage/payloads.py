"""What crosses an edge or reaches a client, as typed records: the one place the connector's
tensor keys are spelled.

A connector moves `dict[str, Tensor]` (connectors/base.py). Everything else handles the
records below; each packs itself to that dict and back:

    record            keys it packs to                           made by -> read by
    TokenDelta        token_ids                                  AR stages -> adapters, vocoders
    HiddenRows        hidden.<layer>, hidden_positions,          AR stages -> hidden_to_embeds,
                      num_prompt_tokens                          the Qwen-Omni talkers
    ThinkerPrompt     prompt_token_ids, tts_embeds, grid.<k>,    Qwen-Omni thinkers (first
                      prompt_positions, rope_delta               chunk) -> their talkers
    CodecFrames       codes, skip_frames, speaker                talkers -> code2wav, token2wav
    AudioChunk        audio, sample_rate                         vocoders -> the client
    Images            images                                     diffusion stages -> the client
    Video             video, fps                                 video stages -> the client
    ConditionImages   condition_token_ids, condition_grids       GLM-Image's AR stage -> its DiT
    ModelTensors      a model's own names (prompt_embeds, ...)   text encoders -> their DiT
    StageInputs       prompt_embeds, mm.<name>, mm.image[.<i>]   the client -> an entry stage

`Payload` is one step's output for one request: each record at most once. `Payload.unpack`
reads a chunk back into records; keys no record claims are `ModelTensors` (the model names
both ends of that edge).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

TOKEN_IDS = "token_ids"
HIDDEN = "hidden."
HIDDEN_POSITIONS = "hidden_positions"
NUM_PROMPT_TOKENS = "num_prompt_tokens"
PROMPT_TOKEN_IDS = "prompt_token_ids"
TTS_EMBEDS = "tts_embeds"
GRID = "grid."
PROMPT_POSITIONS = "prompt_positions"
ROPE_DELTA = "rope_delta"
CODES = "codes"
SKIP_FRAMES = "skip_frames"
SPEAKER = "speaker"
AUDIO = "audio"
SAMPLE_RATE = "sample_rate"     # also an audio stage's handshake fact (its StageInfo)
IMAGES = "images"
VIDEO = "video"
FPS = "fps"
CONDITION_TOKEN_IDS = "condition_token_ids"
CONDITION_GRIDS = "condition_grids"
PROMPT_SPEECH_TOKENS = "prompt_speech_tokens"   # CosyVoice3's voice prompt (VoicePrompt)
PROMPT_MEL = "prompt_mel"
XVECTOR = "xvector"
PROMPT_EMBEDS = "prompt_embeds"
MM = "mm."
INPUT_IMAGE = "image"           # in a stage's multimodal inputs ("mm." cut): image, image.1, ...
MM_POSITIONS = "positions"      # ... and the front door's M-RoPE positions (3, L), with ROPE_DELTA
# ... and the audio parts a MiMo-Audio prompt hears: waveforms one after another, their
# lengths, the prompt position of each one's first speech patch (models/mimo_audio/prompt.py)
AUDIO_WAVEFORMS, AUDIO_LENS, AUDIO_STARTS = "audio_waveforms", "audio_lens", "audio_starts"
# an input processor's fields that go to the entry stage as its multimodal inputs
MEDIA_INPUTS = ("input_features", "audio_feature_lens", "pixel_values", "image_grid_thw",
                "pixel_values_videos", "video_grid_thw", "video_second_per_grid",
                AUDIO_WAVEFORMS, AUDIO_LENS, AUDIO_STARTS)


def _scalar(t: Tensor) -> int:
    return int(t.flatten()[-1])


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """The tokens one step generated."""
    token_ids: list[int]

    def pack(self) -> dict[str, Tensor]:
        return {TOKEN_IDS: torch.tensor(self.token_ids, dtype=torch.int64)}

    @classmethod
    def unpack(cls, tensors: dict[str, Tensor]) -> TokenDelta | None:
        t = tensors.get(TOKEN_IDS)
        return None if t is None else cls(t.tolist())


@dataclass(frozen=True, slots=True)
class HiddenRows:
    """Hidden-state rows of consecutive positions: `layers[n]` (rows, hidden) per captured
    layer (0: the input embeddings), `positions` (rows,) ascending, and the prompt's length
    (rows at positions below it are prompt rows)."""
    layers: dict[int, Tensor]
    positions: Tensor
    num_prompt_tokens: int

    @classmethod
    def from_start(cls, layers: dict[int, Tensor], start: int, num_prompt_tokens: int
                   ) -> HiddenRows:
        num_rows = next(iter(layers.values())).shape[0]
        return cls(layers, torch.arange(start, start + num_rows), num_prompt_tokens)

    @property
    def last(self) -> Tensor:
        """The highest captured layer's rows."""
        return self.layers[max(self.layers)]

    def pack(self) -> dict[str, Tensor]:
        out = {f"{HIDDEN}{n}": h for n, h in self.layers.items()}
        out[HIDDEN_POSITIONS] = self.positions
        out[NUM_PROMPT_TOKENS] = torch.tensor(self.num_prompt_tokens)
        return out

    @classmethod
    def unpack(cls, tensors: dict[str, Tensor]) -> HiddenRows | None:
        layers = {int(k[len(HIDDEN):]): v for k, v in tensors.items() if k.startswith(HIDDEN)}
        if not layers:
            return None
        return cls(dict(sorted(layers.items())), tensors[HIDDEN_POSITIONS],
                   _scalar(tensors[NUM_PROMPT_TOKENS]))


@dataclass(frozen=True, slots=True)
class ThinkerPrompt:
    """What a Qwen-Omni thinker's first chunk adds for its talker: the prompt's ids, and per
    family its tts special tokens' embeddings (3, H) and visual grids (Qwen3-Omni) or the
    prompt's M-RoPE positions (3, L) with their delta (Qwen2.5-Omni)."""
    prompt_token_ids: list[int]
    tts_embeds: Tensor | None = None
    grids: dict[str, Tensor] = field(default_factory=dict)
    positions: Tensor | None = None
    rope_delta: int = 0

    def pack(self) -> dict[str, Tensor]:
        out = {PROMPT_TOKEN_IDS: torch.tensor(self.prompt_token_ids, dtype=torch.long)}
        if self.tts_embeds is not None:
            out[TTS_EMBEDS] = self.tts_embeds
        out.update({f"{GRID}{k}": v for k, v in self.grids.items()})
        if self.positions is not None:
            out[PROMPT_POSITIONS] = self.positions
            out[ROPE_DELTA] = torch.tensor(self.rope_delta)
        return out

    @classmethod
    def unpack(cls, tensors: dict[str, Tensor]) -> ThinkerPrompt | None:
        ids = tensors.get(PROMPT_TOKEN_IDS)
        if ids is None:
            return None
        delta = tensors.get(ROPE_DELTA)
        return cls(ids.tolist(), tensors.get(TTS_EMBEDS),
                   {k[len(GRID):]: v for k, v in tensors.items() if k.startswith(GRID)},
                   tensors.get(PROMPT_POSITIONS), 0 if delta is None else _scalar(delta))


@dataclass(frozen=True, slots=True)
class CodecFrames:
    """Codec tokens for a vocoder: `codes` (frames, groups) for code2wav, (n,) for token2wav;
    `skip_frames` of them left context only (a voice clone's reference frames; packed per
    chunk, summed when chunks join); `speaker` (n,) token2wav's speaker index per token."""
    codes: Tensor
    skip_frames: int | None = None
    speaker: Tensor | None = None

    def pack(self) -> dict[str, Tensor]:
        out = {CODES: self.codes}
        if self.skip_frames is not None:
            out[SKIP_FRAMES] = torch.tensor([self.skip_frames])
        if self.speaker is not None:
            out[SPEAKER] = self.speaker
        return out

    @classmethod
    def unpack(cls, tensors: dict[str, Tensor]) -> CodecFrames | None:
        codes = tensors.get(CODES)
        if codes is None:
            return None
        skip = tensors.get(SKIP_FRAMES)
        return cls(codes, None if skip is None else int(skip.sum()), tensors.get(SPEAKER))


@dataclass(frozen=True, slots=True)
class AudioChunk:
    """Samples float32 (n,) at `sample_rate` Hz (None: the rate the stage reported at start;
    a chunk may carry the rate alone)."""
    samples: Tensor | None
    sample_rate: int | None = None

    def pack(self) -> dict[str, Tensor]:
        out = {} if self.samples is None else {AUDIO: self.samples}
        if self.sample_rate is not None:
            out[SAMPLE_RATE] = torch.tensor(self.sample_rate)
        return out

    @classmethod
    def unpack(cls, tensors: dict[str, Tensor]) -> AudioChunk | None:
        samples = tensors.get(AUDIO)
        rate = tensors.get(SAMPLE_RATE)
        if samples is None and rate is None:
            return None
        return cls(samples, None if rate is None else _scalar(rate))


@dataclass(frozen=True, slots=True)
class Images:
    """Final images, uint8 (n, H, W, C)."""
    pixels: Tensor

    def pack(self) -> dict[str, Tensor]:
        return {IMAGES: self.pixels}

    @classmethod
    def unpack(cls, tensors: dict[str, Tensor]) -> Images | None:
        t = tensors.get(IMAGES)
        return None if t is None else cls(t)


@dataclass(frozen=True, slots=True)
class Video:
    """Final videos' frames, uint8 (n, F, H, W, 3), and their rate when the stage knows it."""
    frames: Tensor
    fps: float | None = None

    def pack(self) -> dict[str, Tensor]:
        out = {VIDEO: self.frames}
        if self.fps is not None:
            out[FPS] = torch.tensor(float(self.fps))
        return out

    @classmethod
    def unpack(cls, tensors: dict[str, Tensor]) -> Video | None:
        t = tensors.get(VIDEO)
        if t is None:
            return None
        fps = tensors.get(FPS)
        return cls(t, None if fps is None else float(fps.flatten()[-1]))


@dataclass(frozen=True, slots=True)
class ConditionImages:
    """GLM-Image's condition images as its AR stage tokenized them, for the DiT's prior: the
    visual token ids of all images back to back (sum h*w,) and each image's grid (K, 2)."""
    token_ids: Tensor
    grids: Tensor

    def pack(self) -> dict[str, Tensor]:
        return {CONDITION_TOKEN_IDS: self.token_ids, CONDITION_GRIDS: self.grids}

    @classmethod
    def unpack(cls, tensors: dict[str, Tensor]) -> ConditionImages | None:
        t = tensors.get(CONDITION_TOKEN_IDS)
        return None if t is None else cls(t, tensors[CONDITION_GRIDS])


@dataclass(frozen=True, slots=True)
class VoicePrompt:
    """A cloned voice for CosyVoice3's flow: the reference clip's speech tokens (P,), its mel
    (2P, mel) and its speaker x-vector (spk,)."""
    tokens: Tensor
    mel: Tensor
    xvector: Tensor

    def pack(self) -> dict[str, Tensor]:
        return {PROMPT_SPEECH_TOKENS: self.tokens, PROMPT_MEL: self.mel, XVECTOR: self.xvector}

    @classmethod
    def unpack(cls, tensors: dict[str, Tensor]) -> VoicePrompt | None:
        t = tensors.get(PROMPT_SPEECH_TOKENS)
        return None if t is None else cls(t, tensors[PROMPT_MEL], tensors[XVECTOR])


@dataclass(frozen=True, slots=True)
class ModelTensors:
    """Tensors under a model's own names: a text encoder's conditioning for its DiT (the
    pipeline writes and reads them), a test model's output. One class owns both ends."""
    tensors: dict[str, Tensor]

    def pack(self) -> dict[str, Tensor]:
        return dict(self.tensors)

    @classmethod
    def unpack(cls, tensors: dict[str, Tensor]) -> ModelTensors | None:
        return cls(dict(tensors)) if tensors else None


RECORDS = (TokenDelta, HiddenRows, ThinkerPrompt, CodecFrames, AudioChunk, Images, Video,
           ConditionImages, VoicePrompt)


@dataclass(slots=True)
class Payload:
    """One step's output for one request, as it goes along the edges and to the client: each
    record at most once (a first AR chunk carries tokens, hidden rows and a thinker prompt)."""
    tokens: TokenDelta | None = None
    hidden: HiddenRows | None = None
    thinker_prompt: ThinkerPrompt | None = None
    codec: CodecFrames | None = None
    audio: AudioChunk | None = None
    images: Images | None = None
    video: Video | None = None
    condition_images: ConditionImages | None = None
    voice_prompt: VoicePrompt | None = None
    named: ModelTensors | None = None          # keys no record claims

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))

    def pack(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for f in fields(self):
            record = getattr(self, f.name)
            if record is not None:
                out.update(record.pack())
        return out

    @classmethod
    def unpack(cls, tensors: dict[str, Tensor]) -> Payload:
        """A chunk's records; the keys no record claims are ModelTensors."""
        out = cls(*(record.unpack(tensors) for record in RECORDS))
        claimed = out.pack()
        out.named = ModelTensors.unpack({k: v for k, v in tensors.items()
                                                if k not in claimed})
        return out


@dataclass(frozen=True, slots=True)
class StageInputs:
    """The client's tensors for an entry stage: prompt embeddings, the model's multimodal
    inputs (audio features, pixels, grids, M-RoPE positions: `multimodal[name]`) and the
    input image files of an edit (encoded bytes as uint8 tensors, `input_image_files`)."""
    prompt_embeds: Tensor | None = None
    multimodal: dict[str, Tensor] = field(default_factory=dict)
    images: tuple[Tensor, ...] = ()

    def pack(self) -> dict[str, Tensor]:
        out = {f"{MM}{k}": v for k, v in self.multimodal.items()}
        out.update({f"{MM}{image_key(i)}": f for i, f in enumerate(self.images)})
        if self.prompt_embeds is not None:
            out[PROMPT_EMBEDS] = self.prompt_embeds
        return out

    @classmethod
    def unpack(cls, tensors: dict[str, Tensor]) -> StageInputs:
        mm = {k[len(MM):]: v for k, v in tensors.items() if k.startswith(MM)}
        return cls(tensors.get(PROMPT_EMBEDS), mm, input_image_files(mm))

    @classmethod
    def of_files(cls, files: list[bytes]) -> StageInputs:
        """A request's input image files, still encoded, as they ride in a connector."""
        return cls(images=tuple(file_tensor(f) for f in files))


def file_tensor(data: bytes) -> Tensor:
    """An image file's bytes as a uint8 tensor (nbytes,): how the file rides in a connector."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def file_bytes(tensor: Tensor) -> bytes:
    """The image file back from its `file_tensor`."""
    return tensor.numpy().tobytes()


def image_key(i: int) -> str:
    """Input image `i`'s name among a stage's multimodal inputs: image, image.1, image.2..."""
    return INPUT_IMAGE if i == 0 else f"{INPUT_IMAGE}.{i}"


def input_image_files(multimodal: dict[str, Tensor]) -> tuple[Tensor, ...]:
    """The input image files among a stage's multimodal inputs, in order."""
    files: list[Tensor] = []
    while (key := image_key(len(files))) in multimodal:
        files.append(multimodal[key])
    return tuple(files)


def final_pixels(pixels: Tensor | Payload | None, is_video: bool) -> Payload:
    """A diffusion stage's output as its record: a video stage's frames, else images; a
    pipeline whose decode makes more than pixels (LTX-2: video and its sound track) returns
    its Payload, which passes as it is."""
    if pixels is None:
        return Payload()
    if isinstance(pixels, Payload):
        return pixels
    return Payload(video=Video(pixels)) if is_video else Payload(images=Images(pixels))
