"""A generation stage: a non-autoregressive model (a vocoder, a decoder) stepped over the
ready chunks of its requests (generation/engine.py), behind the stage interface."""

from __future__ import annotations

import msgspec

from omnistage import registry
from omnistage.configs.options import read_options
from omnistage.configs.schema import StageConfig
from omnistage.payloads import Payload, TokenDelta
from omnistage.stages.adapters import StageFeed
from omnistage.generation.engine import GenerationEngine
from omnistage.stages.interface import EngineStats, StageInfo, StageRequest, StageResult
from omnistage.utils.device import resolve_device, resolve_dtype
from omnistage.outputs import StageMetrics


class GenerationStage:
    def __init__(self, stage: StageConfig, model: str | None, device: str) -> None:
        if not stage.component:
            raise ValueError(f"stage {stage.name!r}: a generation stage needs a component")
        dev = resolve_device(device)
        cls = registry.load_component("generation", stage.component)
        path = stage.model or model
        dtype = None if stage.dtype == "auto" else resolve_dtype(stage.dtype, None, dev)
        options = read_options(cls.Options, stage.generation.options,
                               f"stage {stage.name!r}: generation.options")
        self.engine = GenerationEngine(cls.from_pretrained(path, stage.component, dev, dtype,
                                                           options),
                                       stage.generation.max_num_seqs)

    def add(self, request: StageRequest) -> None:
        self.engine.add_request(request.request_id, request.arrival_time)
        if not request.streamed:
            ids = list(request.prompt_token_ids or [])
            self.engine.feed(request.request_id, TokenDelta(ids).pack(), close=True)

    def feed(self, request_id: str, feed: StageFeed) -> None:
        self.engine.feed(request_id, feed.payload.pack() if feed.payload else None, close=False)

    def close_input(self, request_id: str) -> None:
        self.engine.feed(request_id, None, close=True)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests

    def info(self) -> StageInfo:
        """What the model reports (a vocoder's sample_rate), as the handshake's struct."""
        return msgspec.convert(self.engine.model.info, StageInfo)

    def stats(self) -> EngineStats:
        """Running: the requests the model has run for; waiting: those not yet scheduled."""
        requests = self.engine.requests.values()
        num_running = sum(r.first_scheduled_time is not None for r in requests)
        return EngineStats(num_running, len(requests) - num_running)

    def step(self) -> list[StageResult]:
        results = []
        for r in self.engine.step():
            metrics = None
            if r.finished and r.request is not None and r.request.first_scheduled_time:
                metrics = StageMetrics(
                    queue_time=r.request.first_scheduled_time - r.request.arrival_time,
                    num_chunks=r.request.num_chunks_out, model_seconds=r.request.model_seconds)
            results.append(StageResult(
                r.request_id, payload=Payload.unpack(r.tensors), finished=r.finished,
                finish_reason=("error" if r.error else "stop") if r.finished else None,
                error=r.error, engine_metrics=metrics))
        return results
