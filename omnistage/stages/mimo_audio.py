"""MiMo-Audio as stages of the runtime: the LLM with its patch decoder on the AR engine, the
audio tokenizer's decoder as a generation stage.

    llm (ar)          the processed prompt's ids (models/mimo_audio/prompt.py) + the answer's
                      start: <|sostm|> when the request goes on to the decoder (speech), else
                      upstream's text-dialogue start; prefilled as patch embeddings. Each step
                      the engine samples a text id; an <|empty|> id runs the patch decoder in
                      the model's feedback hook (4 frames x 8 channels of audio ids). Text ids
                      go out as text, speech patches as CodecFrames to the decoder stage.
                      Speech stops at <|eostm|> or <|im_end|> (upstream's MiMoStopper), text
                      at the tokenizer's EOS / <|im_end|>.
    decoder (gen)     the spoken frames -> 24 kHz audio, decoded in chunks while the LLM
                      still speaks (generation/mimo_audio.py)

The patch decoder draws with the request's temperature / top-k / top-p (upstream has its own
sampler settings for it); on CUDA it replays from CUDA graphs (`ar.options.patch_cuda_graphs`,
default on; off with `ar.enforce_eager`). Speech in: a user turn's audio part, laid out by the front door
(models/mimo_audio/prompt.py), is encoded here by the audio tokenizer's encoder into its
speech patches. One preset voice, "default" (the model's own); another voice is cloned from a
reference clip (SamplingParams.extra "ref_audio": an uploaded voice, or the speech route's
ref_audio; "ref_text" accepted, not read: upstream's layouts take no transcript) encoded here the
same way into the place upstream's layout gives it (models/mimo_audio/voice.py); "instructions"
(a style instruction, text to speech only) likewise; "language" accepted, not read (upstream
tells the language from the text).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from omnistage.configs.schema import StageConfig
from omnistage.errors import InputError
from omnistage.generation.mimo_audio import TOKENIZER_FOLDER
from omnistage.layers.graph_capture import checked
from omnistage.models.loader import resolve_model_path
from omnistage.models.mimo_audio.model import MiMoAudioForCausalLM
from omnistage.models.mimo_audio.patch_graphs import PatchGraphs, RowSampling, decode_rows
from omnistage.models.mimo_audio.prompt import (SPEECH_START, TEXT_START, SpecialIds,
                                                segment_ids, speech_patches, text_patches)
from omnistage.models.mimo_audio.tokenizer_encoder import MiMoAudioTokenizerEncoder
from omnistage.models.mimo_audio.voice import (dialogue_segments, layout_ids, tts_segments,
                                               tts_text)
from omnistage.models.qwen3_omni.talker import FRAME_CODES
from omnistage.payloads import AUDIO_LENS, AUDIO_STARTS, AUDIO_WAVEFORMS, CodecFrames, Payload
from omnistage.registry import SpeechSpec
from omnistage.stages.ar import ARStage
from omnistage.stages.interface import StageInfo, StageRequest, StageResult
from omnistage.stages.voice import reference_waveform, requested_voice

VOICE = "default"
VOICE_OPTIONS = ("ref_audio", "ref_text", "instructions", "language")
MIN_CLIP_S, MAX_CLIP_S = 0.5, 60.0      # a reference clip's length (the voice routes' limits)


def speech_spec(path: str | Path) -> SpeechSpec:
    """One preset voice, the model's own; style instructions; cloning when the folder has the
    audio tokenizer's encoder (audio_tokenizer/: it encodes the reference clip)."""
    has_encoder = (Path(path) / TOKENIZER_FOLDER / "config.json").is_file()
    return SpeechSpec(voices=(VOICE,), cloning=has_encoder, instructions=True)


@dataclass(frozen=True, slots=True)
class MiMoAudioOptions:
    """The stage's `ar.options`: patch_cuda_graphs, on CUDA replay the patch decoder (its
    group_size + max(delays) local-transformer passes and draws) as one CUDA graph per
    batch-size bucket, greedy and sampled (checked against eager at start-up)."""
    patch_cuda_graphs: bool = True


def _load(path: Path, device: torch.device, dtype: torch.dtype | None) -> tuple:
    from transformers import AutoTokenizer

    special = SpecialIds.of(AutoTokenizer.from_pretrained(str(path)))
    model = MiMoAudioForCausalLM.from_pretrained(path, special.empty, device,
                                                 dtype or torch.float32)
    return model, model.model_config, None


class MiMoAudioStage(ARStage):
    Options = MiMoAudioOptions

    def __init__(self, stage: StageConfig, model: str, device: str) -> None:
        super().__init__(stage, model, device, loader=_load)
        if self.engine.tokenizer is None:
            raise ValueError(f"{stage.model or model}: no text tokenizer (tokenizer.json)")
        self.special = SpecialIds.of(self.engine.tokenizer)
        self.starts = {speech: segment_ids(self.engine.tokenizer, list(segs))
                       for speech, segs in ((True, SPEECH_START), (False, TEXT_START))}
        self._encoder: MiMoAudioTokenizerEncoder | None = None      # speech in
        self._held: dict[str, list[torch.Tensor]] = {}     # thinking requests' frames (_hold)

    @property
    def model(self) -> MiMoAudioForCausalLM:
        return self.engine.model

    def prepare(self) -> None:
        if (self.engine.device.type == "cuda" and not self.stage.ar.enforce_eager
                and self.options.patch_cuda_graphs):
            self.model.patch_graphs = patch_graphs(self.model, self.stage.ar.max_num_seqs,
                                                   self.engine.device, self.engine.dtype)

    def decode_graph_variant(self) -> tuple[tuple[int, ...], bool]:
        """Every decode is fed embeddings (the feedback hook's patch)."""
        return self.stage.ar.output_hidden_layers, True

    def model_info(self) -> StageInfo:
        return StageInfo(speakers=(VOICE,))

    def add(self, request: StageRequest) -> None:
        params = request.params or self.defaults
        requested_voice(params.extra, VOICE_OPTIONS)
        if request.prompt_token_ids is None:
            raise InputError("prompt: MiMo-Audio takes messages or text (no embeddings)")
        speech = bool(request.downstream)
        if speech:          # upstream's MiMoStopper: <|eostm|> ends the spoken reply
            stops = {*params.stop_token_ids, self.special.eostm, self.special.im_end}
            params = replace(params, stop_token_ids=tuple(sorted(stops)))
        cfg = self.model.cfg
        patches = text_patches(list(request.prompt_token_ids) + self.starts[speech], cfg)
        if request.multimodal and AUDIO_WAVEFORMS in request.multimodal:
            patches = self._with_speech(patches, request.multimodal)
        patches, thinks = self._voiced(patches, request.prompt, params.extra, speech)
        with torch.no_grad():
            embeds = self.model.patch_embeds(patches.to(self.engine.device))
        self.engine.add_request(request.request_id, None, params, embeds.to(self.engine.dtype))
        if thinks:
            self._held[request.request_id] = []

    def _voiced(self, patches: torch.Tensor, prompt: str | None, extra: dict[str, object],
                speech: bool) -> tuple[torch.Tensor, bool]:
        """The prompt's patches in the voice asked for (models/mimo_audio/voice.py): text to
        speech laid out anew around the clip and/or the instruction (a layout ending in
        THINK_START: True), a spoken chat with the clip's system turn before it; as they are
        for the model's own voice."""
        instruction = str(extra.get("instructions") or "") or None
        clip = extra.get("ref_audio")
        if clip is None and instruction is None:
            return patches, False
        param = "ref_audio" if clip is not None else "instructions"
        if not speech:
            raise InputError(f"{param}: only when the answer is spoken", param=param)
        rows = None if clip is None else self._clip_patches(clip)
        text = tts_text(prompt)
        if text is None and instruction is not None:
            raise InputError("instructions: MiMo-Audio takes a style instruction with text to "
                             "speak (/v1/audio/speech), not with chat messages",
                             param="instructions")
        segments = (tts_segments(text, instruction, rows is not None) if text is not None
                    else dialogue_segments())
        ids, clip_idx = layout_ids(self.engine.tokenizer, self.special, segments,
                                   0 if rows is None else rows.shape[0])
        head = text_patches(ids, self.model.cfg)
        if rows is not None and clip_idx is not None:
            head[clip_idx:clip_idx + rows.shape[0]] = rows
        out = head if text is not None else torch.cat([head, patches])
        if out.shape[0] >= self.engine.max_model_len:
            raise InputError(f"{param}: the prompt with the reference clip is {out.shape[0]} "
                             f"positions; this model takes fewer than "
                             f"{self.engine.max_model_len} (a shorter clip)", param=param)
        return out, text is not None

    def _clip_patches(self, clip: object) -> torch.Tensor:
        """A reference clip (voice.reference_waveform's forms) -> its speech patches
        (T, group_size, 1 + channels); InputError for a clip outside MIN_CLIP_S .. MAX_CLIP_S."""
        encoder = self._audio_encoder()
        wave = reference_waveform(clip, encoder.sample_rate)
        seconds = wave.numel() / encoder.sample_rate
        if not MIN_CLIP_S <= seconds <= MAX_CLIP_S or not bool(torch.isfinite(wave).all()):
            raise InputError(f"ref_audio: the clip is {seconds:.2f} s long; MiMo-Audio clones a "
                             f"voice from {MIN_CLIP_S} to {MAX_CLIP_S} s of finite samples",
                             param="ref_audio")
        cfg = self.model.cfg
        with torch.no_grad():
            ids = encoder.speech_ids(wave.to(self.engine.device), cfg.audio_channels,
                                     cfg.group_size)
        return speech_patches(ids.cpu(), cfg)

    def _audio_encoder(self) -> MiMoAudioTokenizerEncoder:
        """The audio tokenizer's encoder, loaded on first use."""
        if self._encoder is None:
            self._encoder = MiMoAudioTokenizerEncoder.from_pretrained(
                resolve_model_path(self.engine.config.model) / TOKENIZER_FOLDER,
                self.engine.device)
        return self._encoder

    def _with_speech(self, patches: torch.Tensor, mm: dict[str, torch.Tensor]) -> torch.Tensor:
        """The prompt's audio parts encoded (the audio tokenizer's encoder) into the speech
        patches the front door laid out for them."""
        encoder = self._audio_encoder()
        cfg = self.model.cfg
        waves = mm[AUDIO_WAVEFORMS].float().split(mm[AUDIO_LENS].tolist())
        for i, (wave, start) in enumerate(zip(waves, mm[AUDIO_STARTS].tolist())):
            ids = encoder.speech_ids(wave.to(self.engine.device), cfg.audio_channels,
                                     cfg.group_size)
            rows = speech_patches(ids.cpu(), cfg)
            laid = patches[start:start + rows.shape[0], 0, 0]
            if laid.shape[0] != rows.shape[0] or bool((laid != cfg.empty_idx).any()):
                raise InputError(f"audio part {i}: {rows.shape[0]} speech patches do not fit "
                                 "the prompt's layout", param="messages")
            patches[start:start + rows.shape[0]] = rows
        return patches

    def abort(self, request_id: str) -> None:
        self._held.pop(request_id, None)
        super().abort(request_id)

    def _hold(self, request_id: str, token_ids: list[int], codes: torch.Tensor | None,
              finished: bool) -> torch.Tensor | None:
        """A thinking request's frames (voice.py's layouts ending <think>) as upstream's forward
        keeps them: those before the model's first <|sostm|> dropped, all of them when it
        writes none (held until it finishes); any other request's as they come."""
        held = self._held.get(request_id)
        if held is None:
            return codes
        if self.special.sostm in token_ids:
            del self._held[request_id]
            return codes
        if codes is not None:
            held.append(codes)
        if not finished:
            return None
        del self._held[request_id]
        return torch.cat(held) if held else None

    def step(self) -> list[StageResult]:
        results = []
        for out in self.engine.step():
            codes = None if out.extra is None else out.extra[FRAME_CODES]
            codes = self._hold(out.request_id, out.new_token_ids, codes, out.finished)
            payload = Payload(codec=None if codes is None else CodecFrames(codes.cpu()))
            results.append(StageResult(
                out.request_id, out.new_token_ids, out.text_delta, payload, out.finished,
                out.finish_reason.value if out.finish_reason else None, out.error,
                out.logprobs))
        return results


@torch.inference_mode()
def patch_graphs(model: MiMoAudioForCausalLM, max_batch: int, device: torch.device,
                 dtype: torch.dtype) -> PatchGraphs | None:
    """The patch decoder's CUDA graphs, every bucket captured, if 2 rows replayed through them
    equal the eager `decode_rows`, greedy and sampled (one greedy row among them);
    otherwise None, and the decoder runs eagerly."""
    cfg = model.cfg
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(2, model.hidden_states_downcast.weight.shape[0], device=device,
                    generator=gen).to(dtype)
    noise = torch.empty(2, cfg.group_size, cfg.audio_channels, max(cfg.vocab_sizes),
                        device=device).exponential_(generator=gen)
    sampling = RowSampling(torch.tensor([0.9, 0.0], dtype=torch.float32, device=device),
                           torch.tensor([20, 0], dtype=torch.int64, device=device),
                           torch.tensor([0.95, 1.0], dtype=torch.float32, device=device), noise)
    graphs = PatchGraphs.build(model, max_batch, device, dtype)
    return checked(graphs, graphs.capture_all,
                   [(lambda s=s: decode_rows(model, x, s), lambda s=s: graphs(x, s))
                    for s in (None, sampling)], "the MiMo-Audio patch decoder")


def build_stage(stage: StageConfig, model: str, device: str) -> ARStage:
    return MiMoAudioStage(stage, model, device)
