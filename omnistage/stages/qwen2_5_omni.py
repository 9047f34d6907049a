"""Qwen2.5-Omni as three stages of the runtime: what `Qwen2_5OmniForConditionalGeneration.
generate(return_audio=True)` does in one process, split so that the talker speaks while the
thinker still writes.

    thinker (ar)    prompt -> text; requests bound for the talker emit, per position, the
                    input embedding (layer 0) and the last hidden state (after the norm), and
                    their first chunk carries the prompt ids (and M-RoPE positions, if any)
    talker (ar)     prefill = the prompt's rows (embedding + hidden state; media placeholder
                    rows the hidden state alone, as the reference), the speaker's text bos,
                    the first reply row (models/qwen2_5_omni/talker.py), at the thinker's
                    positions continued; each decode adds
                    the next reply row, then text eos, then text pad (the engine's input
                    stream); one codec token per step
    token2wav (gen) the codec tokens, chunk by chunk while the talker speaks -> mel (DiT +
                    RK4 on windows of context) -> 24 kHz waveform, streamed
                    (generation/token2wav.py)

Prompts may hold audio, images and videos: the input processor (models/qwen2_5_omni/
processing.py) expands their placeholders and computes the M-RoPE positions at the front door;
the thinker stage runs the encoders (audio_encoder.py, vision_encoder.py) and merges their
outputs into the prompt embeddings (stages/media.py). Speakers are the checkpoint's spk_dict.pt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from omnistage.ar.inputs import MultimodalInput, StreamInput
from omnistage.configs.schema import StageConfig
from omnistage.models.loader import resolve_model_path
from omnistage.models.qwen2_5_omni.audio_encoder import Qwen2_5OmniAudioEncoder
from omnistage.models.qwen2_5_omni.processing import Qwen2_5OmniInputProcessor
from omnistage.models.qwen2_5_omni.talker import Qwen2_5OmniTalkerForCausalLM
from omnistage.models.qwen2_5_omni.thinker import (
    Qwen2_5OmniThinkerForCausalLM,
    thinker_embedding_rows,
)
from omnistage.models.qwen2_5_omni.token2wav import load_speakers
from omnistage.models.qwen2_5_omni.vision_encoder import Qwen2_5OmniVisionEncoder
from omnistage.models.qwen3_omni.multimodal import SpecialTokens
from omnistage.payloads import (MM_POSITIONS, ROPE_DELTA, CodecFrames, HiddenRows, Payload,
                                ThinkerPrompt)
from omnistage.sampling_params import SamplingParams
from omnistage.stages.ar import ARStage
from omnistage.stages.interface import StageRequest, StageResult
from omnistage.stages.talker import OmniTalkerStage, OmniThinkerStage, load_component

DEFAULT_SPEAKER = "chelsie"         # the reference's `speaker="Chelsie"`


class ThinkerStage(OmniThinkerStage):
    """The thinker: its talker takes layer 0 and the last hidden state; the first chunk
    carries the prompt ids and, with media, the prompt's M-RoPE positions."""

    model_class = Qwen2_5OmniThinkerForCausalLM

    def special_tokens(self) -> SpecialTokens:
        return Qwen2_5OmniInputProcessor.special_tokens(self.engine.hf_config.thinker_config,
                                                        self.engine.tokenizer)

    def encoders(self) -> tuple[type[torch.nn.Module], type[torch.nn.Module]]:
        return Qwen2_5OmniAudioEncoder, Qwen2_5OmniVisionEncoder

    def hidden_layers_for_talker(self) -> tuple[int, ...]:
        return (0, self.engine.model_config.num_hidden_layers)

    def thinker_prompt(self, request: StageRequest) -> ThinkerPrompt:
        mm = request.multimodal or {}
        prompt = ThinkerPrompt(list(request.prompt_token_ids or []))
        if MM_POSITIONS in mm:
            prompt = ThinkerPrompt(prompt.prompt_token_ids, positions=mm[MM_POSITIONS],
                                   rope_delta=int(mm[ROPE_DELTA]))
        return prompt


@dataclass(slots=True)
class _TalkerInput:
    """What the talker has received of one request from the thinker (thinker space)."""
    speaker_idx: int
    params: SamplingParams
    prompt_ids: list[int] | None = None
    positions: Tensor | None = None        # the prompt's M-RoPE positions (3, L), with media
    rope_delta: int = 0
    rows: list[Tensor] = field(default_factory=list)   # embedding + last hidden, by position
    num_sent: int = 0                                  # rows handed to the engine
    closed: bool = False


class TalkerStage(OmniTalkerStage):
    """The talker's AR engine. A request enters the engine once the thinker's first reply row
    is in (its prompt needs it), with its real ids beside the embeddings (the reference's
    repetition penalty counts them); its codec tokens go on to token2wav with the speaker's
    index in the checkpoint's speaker map."""

    sort_speakers = False   # the checkpoint's order (its spk_dict.pt)

    def __init__(self, stage: StageConfig, model: str, device: str) -> None:
        super().__init__(stage, model, device,
                         loader=load_component(Qwen2_5OmniTalkerForCausalLM))
        path = resolve_model_path(stage.model or model)
        speakers = load_speakers(path)
        self.speakers = {name: i for i, name in enumerate(speakers)}
        self.default_speaker = DEFAULT_SPEAKER
        cfg = self.model.config
        text = thinker_embedding_rows(path, [cfg.text_eos_id, cfg.text_pad_id,
                                             *(s.bos_token for s in speakers.values())])
        self.text_rows = text.to(self.engine.device, self.engine.dtype)  # eos, pad, bos...
        thinker = self.engine.hf_config.thinker_config
        self.last_layer = thinker.text_config.num_hidden_layers
        self.media_ids = {thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id}
        self.inputs: dict[str, _TalkerInput] = {}
        self._fed: set[str] = set()                      # requests fed since the last step
        self._speaker: dict[str, int] = {}               # request -> speaker index, to the end

    @property
    def model(self) -> Qwen2_5OmniTalkerForCausalLM:
        return self.engine.model

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self._fed) or self.engine.has_unfinished_requests

    def add(self, request: StageRequest) -> None:
        params, speaker_idx = self.resolve_speaker(request)
        self.inputs[request.request_id] = _TalkerInput(speaker_idx, params)
        self._speaker[request.request_id] = speaker_idx

    def abort(self, request_id: str) -> None:
        self.inputs.pop(request_id, None)
        self._speaker.pop(request_id, None)
        self._fed.discard(request_id)
        super().abort(request_id)

    def accepts(self, request_id: str) -> bool:
        """Rows for a request the talker has finished (it said EOS first) are dropped."""
        return request_id in self.inputs

    def on_prompt(self, request_id: str, prompt: ThinkerPrompt) -> None:
        state = self.inputs[request_id]
        state.prompt_ids = prompt.prompt_token_ids
        if prompt.positions is not None:
            state.positions, state.rope_delta = prompt.positions, prompt.rope_delta

    def on_rows(self, request_id: str, rows: HiddenRows) -> None:
        state = self.inputs[request_id]
        assert int(rows.positions[0]) == len(state.rows), "thinker rows arrive in order, once each"
        embeds = rows.layers[0].float()
        media = self._media_rows(state.prompt_ids or [], rows.positions)
        state.rows.extend((embeds.masked_fill(media[:, None], 0.0)
                           + rows.layers[self.last_layer].float()).unbind(0))

    def mark_fed(self, request_id: str) -> None:
        self._fed.add(request_id)

    def _media_rows(self, prompt_ids: list[int], positions: Tensor) -> Tensor:
        """(n,) bool: which of these thinker rows are audio / image / video placeholders of
        the prompt. The reference speaks from their hidden states only, their input
        embeddings (the encoders' outputs) zeroed."""
        return torch.tensor([int(p) < len(prompt_ids) and prompt_ids[int(p)] in self.media_ids
                             for p in positions.tolist()], dtype=torch.bool)

    def close_input(self, request_id: str) -> None:
        if request_id in self.inputs:
            self.inputs[request_id].closed = True
            self._fed.add(request_id)

    @torch.inference_mode()
    def _apply_input(self) -> list[StageResult]:
        """Hand the engine what the thinker sent since the last step; a request whose input
        is unusable fails alone."""
        failed = []
        fed, self._fed = self._fed, set()
        for rid in fed:
            state = self.inputs.get(rid)
            if state is None:
                continue
            try:
                self._prepare(rid, state)
            except ValueError as exc:
                failed.append(self.failed(rid, exc))
            if state.closed:
                self.inputs.pop(rid, None)
        return failed

    def _prepare(self, request_id: str, state: _TalkerInput) -> None:
        """Prefill once the prompt's rows and the first reply row are in; then stream the new
        reply rows; at the close, text eos, then text pad for ever after."""
        if state.prompt_ids is None:
            if state.closed:
                raise ValueError("the thinker sent no rows to speak")
            return
        num_prompt = len(state.prompt_ids)
        if state.num_sent == 0 and len(state.rows) > num_prompt:
            self._prefill(request_id, state, num_prompt)
        elif state.num_sent == 0:
            if state.closed:
                raise ValueError("the thinker's answer is one token: nothing to speak")
            return
        rows = [self._device(torch.stack(state.rows[state.num_sent:]))] \
            if len(state.rows) > state.num_sent else []
        state.num_sent = len(state.rows)
        if state.closed:
            rows.append(self.text_rows[:1])                                 # text eos
        if not rows:
            return
        project = self.model.project_stream
        self.engine.extend_request(
            request_id, stream_embeds=project(torch.cat(rows)), close_stream=state.closed,
            stream_pad=project(self.text_rows[1]) if state.closed else None)   # text pad

    def _prefill(self, request_id: str, state: _TalkerInput, num_prompt: int) -> None:
        cfg = self.model.config
        rows = self._device(torch.stack(state.rows[:num_prompt + 1]))
        embeds = self.model.prompt_embeds(rows[:num_prompt], self.text_rows[2 + state.speaker_idx],
                                          rows[num_prompt])
        ids = [cfg.codec_mask_id] * num_prompt + [cfg.codec_pad_id, cfg.codec_bos_id]
        mm = None
        if state.positions is not None:     # the thinker's, then text bos and the first reply
            after = int(state.positions.max()) + 1 + torch.arange(2)
            mm = MultimodalInput(torch.cat([state.positions, after.expand(3, -1)], dim=1),
                                 state.rope_delta)
        self.engine.add_request(request_id, ids, state.params, prompt_embeds=embeds,
                                stream=StreamInput(), mm=mm)
        state.num_sent = num_prompt + 1

    def _device(self, rows: Tensor) -> Tensor:
        return rows.to(self.engine.device, self.engine.dtype)

    def step(self) -> list[StageResult]:
        results = self._apply_input()
        eos = set(self.engine.eos_token_ids)
        for out in self.engine.step():
            codes = [c for c in out.new_token_ids if c not in eos]
            payload = Payload()
            if codes:
                payload.codec = CodecFrames(
                    torch.tensor(codes, dtype=torch.long),
                    speaker=torch.full((len(codes),), self._speaker[out.request_id]))
            if out.finished:
                self._speaker.pop(out.request_id, None)
                self.inputs.pop(out.request_id, None)
            results.append(StageResult(
                out.request_id, out.new_token_ids, "", payload, out.finished,
                out.finish_reason.value if out.finish_reason else None, out.error))
        return results


def build_stage(stage: StageConfig, model: str, device: str) -> ARStage:
    if stage.component == "qwen2_5_omni_thinker":
        return ThinkerStage(stage, model, device)
    return TalkerStage(stage, model, device)
