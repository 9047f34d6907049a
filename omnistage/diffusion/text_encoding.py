"""The engine of a split graph's text-encoder stage: a diffusion pipeline's prompt encoder
(`PromptEncoder`, diffusion/pipeline.py) serving requests in batches. Its output, per request,
is the conditioning the diffusion stage downstream denoises with (prompt_embeds, and pooled or
negative_prompt_embeds as the pipeline needs them).

    add_request:  check the prompt and its text fields (negative prompt, guidance), queue it
    step():       up to max_num_seqs queued requests, oldest first -> encoder.encode() once
                  -> one finished result per request with its conditioning tensors

A request is done in the step that takes it; a failing batch fails its requests, not the engine.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipeline import PromptEncoder
from omnistage.outputs import StageMetrics
from omnistage.errors import StageError

logger = logging.getLogger(__name__)

# A stage component "<pipeline>.text_encoder" (e.g. "flux.text_encoder") runs this engine over
# that pipeline's prompt encoder (stages/text_encoder.py, TextEncoderStage).
TEXT_ENCODER_PART = "text_encoder"


@dataclass(slots=True)
class TextEncodingRequest:
    request_id: str
    prompt: str
    params: DiffusionParams
    arrival_time: float


@dataclass(slots=True)
class TextEncodingResult:
    request_id: str
    tensors: dict[str, Tensor]         # the conditioning; empty on error
    error: StageError | None = None
    metrics: StageMetrics | None = None


class TextEncodingEngine:
    def __init__(self, encoder: PromptEncoder, max_num_seqs: int = 64) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs}: must be >= 1")
        self.encoder = encoder
        self.max_num_seqs = max_num_seqs
        self.requests: OrderedDict[str, TextEncodingRequest] = OrderedDict()
        self.num_batches_run = 0

    def add_request(self, request_id: str, prompt: str, params: DiffusionParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        params.validate()
        self.encoder.validate(prompt, params)
        self.requests[request_id] = TextEncodingRequest(request_id, prompt, params,
                                                        arrival_time or time.time())

    def abort(self, request_id: str) -> TextEncodingRequest | None:
        return self.requests.pop(request_id, None)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def step(self) -> list[TextEncodingResult]:
        batch = list(self.requests.values())[:self.max_num_seqs]
        if not batch:
            return []
        for r in batch:
            del self.requests[r.request_id]
        start = time.time()
        conds = self._encode_isolating(batch)
        self.num_batches_run += 1
        done = time.time()
        assert len(conds) == len(batch), (len(conds), len(batch))
        return [TextEncodingResult(r.request_id, {}, StageError.internal(cond))
                if isinstance(cond, str)
                else TextEncodingResult(r.request_id, cond, metrics=StageMetrics(
                    queue_time=start - r.arrival_time, encode_time=done - start,
                    num_batched_requests=len(batch)))
                for r, cond in zip(batch, conds)]

    def _encode_isolating(self, batch: list[TextEncodingRequest]
                          ) -> list[dict[str, Tensor] | str]:
        """Each request's conditioning, or its error: a batch that fails is encoded again one
        request at a time (encoding keeps no state), so one prompt that breaks the encoder
        fails alone."""
        try:
            with torch.inference_mode():
                return self.encoder.encode([r.prompt for r in batch], [r.params for r in batch])
        except Exception as exc:
            logger.exception("text encoding failed for %d requests", len(batch))
            if len(batch) == 1:
                return [f"{type(exc).__name__}: {exc}"]
        conds: list[dict[str, Tensor] | str] = []
        for r in batch:
            try:
                with torch.inference_mode():
                    conds += self.encoder.encode([r.prompt], [r.params])
            except Exception as alone:
                conds.append(f"{type(alone).__name__}: {alone}")
        return conds
