"""What the Qwen-Omni families' thinker and talker stages share (Qwen3-Omni: qwen3_omni.py,
Qwen2.5-Omni: qwen2_5_omni.py); each family fills in its hooks.

    OmniThinkerStage   an AR stage with the family's encoders (stages/media.py); requests
                       bound for the talker emit its layers (`hidden_layers_for_talker`) and
                       their first chunk carries a ThinkerPrompt (`thinker_prompt`)
    OmniTalkerStage    an AR stage fed by the thinker: the speaker checked at add, the
                       thinker's chunks recorded (`on_prompt`, `on_rows`, `on_tokens`) and
                       handed to the engine at the next step (`apply_input`), a request whose
                       input is unusable failed alone

Both load their component with `load_component`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn
from transformers import AutoConfig

from omnistage.configs.schema import StageConfig
from omnistage.errors import InputError, StageError
from omnistage.models.loader import resolve_model_path
from omnistage.models.qwen3_omni.multimodal import SpecialTokens
from omnistage.payloads import HiddenRows, ThinkerPrompt, TokenDelta
from omnistage.sampling_params import SamplingParams
from omnistage.stages.adapters import StageFeed
from omnistage.stages.ar import ARStage
from omnistage.stages.interface import StageInfo, StageRequest, StageResult
from omnistage.stages.media import ThinkerMedia
from omnistage.stages.voice import requested_voice


def load_component(cls: type) -> Callable[[Path, torch.device, torch.dtype | None], tuple]:
    """An AR engine's model loader for one component class of a Qwen-Omni checkpoint."""
    def load(path: Path, device: torch.device, dtype: torch.dtype | None) -> tuple:
        model = cls.from_pretrained(path, device, dtype)
        return model, model.model_config, AutoConfig.from_pretrained(path)
    return load


class OmniThinkerStage(ARStage):
    """The thinker's AR engine plus its encoders, run when a request brings multimodal
    features. A family gives its model class, special tokens and encoders, the layers its
    talker takes and what the talker's first chunk carries."""

    model_class: type[nn.Module]

    def __init__(self, stage: StageConfig, model: str, device: str) -> None:
        super().__init__(stage, model, device, loader=load_component(self.model_class))
        self.media = ThinkerMedia(self.engine, resolve_model_path(stage.model or model),
                                  self.special_tokens(), *self.encoders())
        # requests owing the talker their first chunk's ThinkerPrompt
        self._first: dict[str, ThinkerPrompt] = {}

    def special_tokens(self) -> SpecialTokens:
        raise NotImplementedError

    def encoders(self) -> tuple[type[nn.Module], type[nn.Module]]:
        """The audio and the vision encoder classes (loaded when first needed)."""
        raise NotImplementedError

    def hidden_layers_for_talker(self) -> tuple[int, ...]:
        """The hidden layers the talker takes (0: the input embeddings)."""
        raise NotImplementedError

    def thinker_prompt(self, request: StageRequest) -> ThinkerPrompt:
        """What a request's first chunk to the talker carries besides its rows."""
        raise NotImplementedError

    def prepare(self) -> None:
        # emitted by decodes of the requests bound for the talker
        self.talker_layers = self.hidden_layers_for_talker()

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
            self._first[request.request_id] = self.thinker_prompt(request)

    def abort(self, request_id: str) -> None:
        self._first.pop(request_id, None)
        super().abort(request_id)

    def step(self) -> list[StageResult]:
        results = super().step()
        for r in results:
            if r.payload.hidden is not None and r.request_id in self._first:
                r.payload.thinker_prompt = self._first.pop(r.request_id)
            if r.finished:
                self._first.pop(r.request_id, None)
        return results


class OmniTalkerStage(ARStage):
    """The talker's AR engine, fed by the thinker's chunks: `speakers` (name -> the family's
    speaker id) and `default_speaker` set by the family before `resolve_speaker`."""

    speakers: dict[str, int]
    default_speaker: str
    sort_speakers = True         # list them sorted (else in the checkpoint's order)

    def speaker_names(self) -> list[str]:
        return sorted(self.speakers) if self.sort_speakers else list(self.speakers)

    def model_info(self) -> StageInfo:
        """Reported at the handshake, so the front door refuses an unknown voice at once."""
        return StageInfo(speakers=tuple(self.speaker_names()))

    def resolve_speaker(self, request: StageRequest) -> tuple[SamplingParams, int]:
        """The request's params and the id of the voice it asks for; InputError naming
        `speaker` for one the checkpoint lacks, ValueError for a request not from the
        thinker."""
        params = request.params or self.defaults
        if not request.streamed:
            raise ValueError("the talker takes its input from the thinker")
        speaker = (requested_voice(params.extra) or self.default_speaker).lower()
        if speaker not in self.speakers:
            raise InputError(f"speaker {speaker!r} is unknown (this model has: "
                             f"{', '.join(self.speaker_names())})", param="speaker")
        return params, self.speakers[speaker]

    def feed(self, request_id: str, feed: StageFeed) -> None:
        """Record what the thinker sent (`on_prompt`, `on_rows`, `on_tokens`); it reaches
        the engine at the next step, batched with every other request's."""
        payload = feed.payload
        if payload is None or not self.accepts(request_id):
            return
        if payload.thinker_prompt is not None:
            self.on_prompt(request_id, payload.thinker_prompt)
        if payload.hidden is not None:
            self.on_rows(request_id, payload.hidden)
        if payload.tokens is not None:
            self.on_tokens(request_id, payload.tokens)
        self.mark_fed(request_id)

    def accepts(self, request_id: str) -> bool:
        """Whether the request still takes input (a talker that said EOS first does not)."""
        raise NotImplementedError

    def on_prompt(self, request_id: str, prompt: ThinkerPrompt) -> None:
        raise NotImplementedError

    def on_rows(self, request_id: str, rows: HiddenRows) -> None:
        raise NotImplementedError

    def on_tokens(self, request_id: str, tokens: TokenDelta) -> None:
        """The thinker's generated tokens (a family that reads only rows ignores them)."""

    def mark_fed(self, request_id: str) -> None:
        raise NotImplementedError

    def failed(self, request_id: str, exc: Exception) -> StageResult:
        """A request whose input is unusable: it alone fails (its engine state aborted)."""
        self.abort(request_id)
        return StageResult(request_id, finished=True, finish_reason="error",
                           error=StageError.internal(f"{type(exc).__name__}: {exc}"))


def stack_rows(rows: list[Tensor], device: torch.device, dtype: torch.dtype) -> Tensor:
    """Recorded thinker rows (each (H,)) as one (n, H) tensor on the talker's device."""
    return torch.stack(rows).to(device, dtype)
