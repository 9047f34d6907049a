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

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoConfig

from omnistage.ar.inputs import MultimodalInput, StreamInput
from omnistage.configs.schema import StageConfig
from omnistage.errors import InputError
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
from omnistage.sampling_params import SamplingParams
from omnistage.stages.adapters import StageFeed
from omnistage.stages.ar import ARStage
from omnistage.stages.interface import StageInfo, StageRequest, StageResult
from omnistage.stages.media import ThinkerMedia
from omnistage.stages.voice import requested_voice

DEFAULT_SPEAKER = "chelsie"         # the reference's `speaker="Chelsie"`


def _load(cls: type, path: Path, device: torch.device, dtype: torch.dtype | None) -> tuple:
    model = cls.from_pretrained(path, device, dtype)
    return model, model.model_config, AutoConfig.from_pretrained(path)


class ThinkerStage(ARStage):
    def __init__(self, stage: StageConfig, model: str, device: str) -> None:
        super().__init__(stage, model, device,
                         loader=lambda p, d, t: _load(Qwen2_5OmniThinkerForCausalLM, p, d, t))
        tokens = Qwen2_5OmniInputProcessor.special_tokens(self.engine.hf_config.thinker_config,
                                                          self.engine.tokenizer)
        self.media = ThinkerMedia(self.engine, resolve_model_path(stage.model or model), tokens,
                                  {"audio": Qwen2_5OmniAudioEncoder,
                                   "vision": Qwen2_5OmniVisionEncoder})
        # requests owing the talker their prompt: ids, and M-RoPE positions with their delta
        self._first: dict[str, dict[str, Tensor]] = {}

    def prepare(self) -> None:
        # the layers the talker takes: emitted by decodes of the requests bound for it
        self.talker_layers = (0, self.engine.model_config.num_hidden_layers)

    def decode_graph_variant(self) -> tuple[tuple[int, ...], bool]:
        return self.talker_layers, False

    def add(self, request: StageRequest) -> None:
        if request.streamed:
            raise ValueError("the thinker is an entry stage")
        params = request.params or self.defaults
        if request.downstream and not params.output_hidden_layers:
            params = replace(params, output_hidden_layers=self.talker_layers)
        prompt_embeds, mm_input, cache_ids = self.media.request_inputs(
            request.prompt_token_ids, request.multimodal, request.prompt_embeds)
        self.engine.add_request(request.request_id, request.prompt_token_ids, params,
                                prompt_embeds, mm=mm_input, cache_ids=cache_ids)
        if request.downstream:
            mm = request.multimodal or {}
            first = {"prompt_token_ids": torch.tensor(request.prompt_token_ids or [])}
            if "positions" in mm:
                first.update(prompt_positions=mm["positions"], rope_delta=mm["rope_delta"])
            self._first[request.request_id] = first

    def abort(self, request_id: str) -> None:
        self._first.pop(request_id, None)
        super().abort(request_id)

    def step(self) -> list[StageResult]:
        results = super().step()
        for r in results:
            if r.request_id in self._first and "hidden_positions" in r.tensors:
                r.tensors.update(self._first.pop(r.request_id))
            if r.finished:
                self._first.pop(r.request_id, None)
        return results


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


class TalkerStage(ARStage):
    """The talker's AR engine. A request enters the engine once the thinker's first reply row
    is in (its prompt needs it), with its real ids beside the embeddings (the reference's
    repetition penalty counts them); its codec tokens go on to token2wav with the speaker's
    index in the checkpoint's speaker map."""

    def __init__(self, stage: StageConfig, model: str, device: str) -> None:
        super().__init__(stage, model, device,
                         loader=lambda p, d, t: _load(Qwen2_5OmniTalkerForCausalLM, p, d, t))
        path = resolve_model_path(stage.model or model)
        speakers = load_speakers(path)
        self.speakers = {name: i for i, name in enumerate(speakers)}
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

    def model_info(self) -> StageInfo:
        """Reported at the handshake, so the front door refuses an unknown voice at once."""
        return {"speakers": ",".join(self.speakers)}

    def add(self, request: StageRequest) -> None:
        params = request.params or self.defaults
        if not request.streamed:
            raise ValueError("the talker takes its input from the thinker")
        speaker = (requested_voice(params.extra) or DEFAULT_SPEAKER).lower()
        if speaker not in self.speakers:
            raise InputError(f"speaker {speaker!r} is unknown (this model has: "
                             f"{', '.join(self.speakers)})", param="speaker")
        self.inputs[request.request_id] = _TalkerInput(self.speakers[speaker], params)
        self._speaker[request.request_id] = self.speakers[speaker]

    def abort(self, request_id: str) -> None:
        self.inputs.pop(request_id, None)
        self._speaker.pop(request_id, None)
        self._fed.discard(request_id)
        super().abort(request_id)

    def feed(self, request_id: str, feed: StageFeed) -> None:
        """Record the thinker's rows; they reach the engine at the next step. Rows for a
        request the talker has finished (it said EOS first) are dropped."""
        state, t = self.inputs.get(request_id), feed.tensors or {}
        if state is None:
            return
        if "prompt_token_ids" in t:
            state.prompt_ids = t["prompt_token_ids"].tolist()
        if "prompt_positions" in t:
            state.positions, state.rope_delta = t["prompt_positions"], int(t["rope_delta"])
        if "hidden.0" in t:
            assert int(t["hidden_positions"][0]) == len(state.rows), \
                "thinker rows arrive in order, once each"
            embeds = t["hidden.0"].float()
            media = self._media_rows(state.prompt_ids or [], t["hidden_positions"])
            rows = embeds.masked_fill(media[:, None], 0.0) + t[f"hidden.{self.last_layer}"].float()
            state.rows.extend(rows.unbind(0))
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
                self.abort(rid)
                failed.append(StageResult(rid, finished=True, finish_reason="error",
                                          error=f"{type(exc).__name__}: {exc}"))
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
            tensors = {}
            if codes:
                tensors = {"codes": torch.tensor(codes, dtype=torch.long),
                           "speaker": torch.full((len(codes),), self._speaker[out.request_id])}
            if out.finished:
                self._speaker.pop(out.request_id, None)
                self.inputs.pop(out.request_id, None)
            results.append(StageResult(
                out.request_id, out.new_token_ids, "", tensors, out.finished,
                out.finish_reason.value if out.finish_reason else None, out.error))
        return results


def build_stage(stage: StageConfig, model: str, device: str) -> ARStage:
    if stage.component == "qwen2_5_omni_thinker":
        return ThinkerStage(stage, model, device)
    return TalkerStage(stage, model, device)
