"""The records of the model registry (registry.py): what a family row is made of. Apart so the
table and its lookups stay one readable file; registry.py re-exports every name here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ComponentKind = Literal["ar", "diffusion", "generation"]


@dataclass(frozen=True, slots=True)
class Component:
    """What a stage's `component:` names, by kind: for `ar`, a function (stage, model, device)
    -> stage engine, for an AR model with its own input handling; for `diffusion`, a pipeline
    class; for `generation`, a model class. Both classes have `from_pretrained(path, component,
    device, dtype)`."""

    kind: ComponentKind
    name: str
    target: str           # "module:attribute"


@dataclass(frozen=True, slots=True)
class SpeechSpec:
    """What a text-to-speech family offers, for /v1/audio/speech and its WebSocket to check a
    request against before any stage runs (and to list the preset voices). How a request
    reaches the model: SamplingParams.extra of the entry stage, with "voice" (a preset),
    "ref_audio" ({"samples": float32 little-endian mono bytes, "sample_rate": int}) and
    "ref_text" (cloning), "instructions" and "language", each only when given."""

    voices: tuple[str, ...] = ()       # preset speakers; the first is the default
    cloning: bool = False              # a voice from a reference clip (ref_audio, uploads)
    voice_design: bool = False         # `instructions` alone describe the voice
    instructions: bool = False         # a style instruction along with a preset voice
    languages: tuple[str, ...] = ()    # accepted `language` values, lowercase (empty: any)
    max_input_chars: int = 4096
    speakers: int = 1                  # > 1: a script's speakers, each its own voice (`voices`)

    def __post_init__(self) -> None:
        if not (self.voices or self.cloning or self.voice_design):
            raise ValueError("SpeechSpec: a speech model needs preset voices, cloning or "
                             "voice design")
        if self.max_input_chars < 1:
            raise ValueError(f"SpeechSpec.max_input_chars={self.max_input_chars}: must be >= 1")


@dataclass(frozen=True, slots=True)
class VideoSpec:
    """What a video family makes, for /v1/videos to check a request against before any stage
    runs. Frame counts follow `num_frames = frame_offset + frame_multiple * k` (Wan's VAE: 1 +
    4k); width and height are multiples of `size_multiple` (even: MP4 needs it). How a request
    reaches the model: DiffusionParams of the diffusion stages with `num_frames`, `fps`, height
    and width always set (the defaults here filled in), `image` the first frame's image file
    for image-to-video. What comes back: the final output's tensors["video"], uint8
    (num_videos, F, H, W, 3), from a pipeline whose `decode` returns it (the graph's last
    stage says `final: video`)."""

    default_size: tuple[int, int] = (832, 480)   # (width, height)
    size_multiple: int = 16
    default_num_frames: int = 81
    max_num_frames: int = 81
    frame_multiple: int = 4
    frame_offset: int = 1
    fps: int = 16                      # what the model was trained at: the file's default rate
    text_to_video: bool = True         # False: image-to-video only (input_reference required)
    image_to_video: bool = False       # takes a first frame (input_reference)
    audio: bool = False                # its output carries a sound track (LTX-2): muxed into
                                       # the MP4, and served alone (variant=audio)
    upsample: bool = False             # the folder has a latent upsampler a request may ask
                                       # for (LTX-2's two-stage recipe: `upsample`)

    def __post_init__(self) -> None:
        if self.size_multiple < 2 or self.size_multiple % 2:
            raise ValueError(f"VideoSpec.size_multiple={self.size_multiple}: must be even")
        if not (self.text_to_video or self.image_to_video):
            raise ValueError("VideoSpec: a video model makes video from text, an image or both")
        for n in (self.default_num_frames, self.max_num_frames):
            if not self.valid_num_frames(n):
                raise ValueError(f"VideoSpec: {n} frames breaks the model's own rule "
                                 f"({self.frame_rule})")
        if any(side % self.size_multiple for side in self.default_size):
            raise ValueError(f"VideoSpec.default_size={self.default_size}: not multiples of "
                             f"{self.size_multiple}")

    @property
    def frame_rule(self) -> str:
        return f"{self.frame_offset} + {self.frame_multiple}k frames"

    def valid_num_frames(self, n: int) -> bool:
        return n >= max(1, self.frame_offset) \
            and (n - self.frame_offset) % self.frame_multiple == 0

    def num_frames_for(self, seconds: float, fps: float) -> int:
        """The frame count nearest `seconds` at `fps` that the rule allows (at least one)."""
        least = 0 if self.frame_offset >= 1 else 1
        k = max(least, round((seconds * fps - self.frame_offset) / self.frame_multiple))
        return self.frame_offset + self.frame_multiple * k


@dataclass(frozen=True, slots=True)
class ModelFamily:
    name: str                                  # the prefix of its adapters' names
    architectures: tuple[str, ...] = ()        # config.json "architectures" it serves
    diffusers_classes: tuple[str, ...] = ()    # model_index.json "_class_name" it serves
    any_diffusers: bool = False                # serves the diffusers folders no row names
    graph: str | None = None                   # default graph, a YAML file in omnistage/configs/
    model: str | None = None                   # AR model class, loaded by architecture
    components: tuple[Component, ...] = ()
    processor: str | None = None               # the entry stage's input processor class
    adapters: str | None = None                # module registering adapters "<name>.*"
    # text to speech (/v1/audio/speech): the spec, or a "module:function" target called with
    # the checkpoint folder when its variants differ (preset voices in one, cloning in another)
    speech: SpeechSpec | str | None = None
    # video (/v1/videos): the spec, or a "module:function" target called with the checkpoint
    # folder (Wan2.1 and Wan2.2-TI2V differ in frame rate and image-to-video)
    video: VideoSpec | str | None = None
    # pip extras of omnistage it needs beyond the serving install (checked before any stage
    # starts, so a missing one is one line naming the extra, not a stage's traceback)
    extras: tuple[str, ...] = ()
    tokenizer: str | None = None               # the folder's subfolder holding its text tokenizer
    # full duplex (/v1/duplex): the "module:Class" of its batched session step, built with
    # (folder, device=, dtype=, max_sessions=); such a model is served by entrypoints/openai/
    # duplex/ with no stage graph
    duplex: str | None = None
