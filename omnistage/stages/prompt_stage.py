"""What every diffusion-kind entry stage without a streamed input shares (stages/diffusers.py's
generic adapter, stages/text_encoder.py's split text encoders): a request is a text prompt with
its DiffusionParams, handed to an engine that batches them (`add_request`, `abort`,
`has_unfinished_requests`); nothing arrives later on an edge."""

from __future__ import annotations

from typing import Protocol

from omnistage.stages.adapters import StageFeed
from omnistage.stages.diffusion_component import request_params
from omnistage.stages.interface import StageRequest


class PromptEngine(Protocol):
    has_unfinished_requests: bool

    def add_request(self, request_id: str, prompt: object, params: object,
                    arrival_time: float) -> None: ...

    def abort(self, request_id: str) -> None: ...


class PromptEntryStage:
    """The stage interface's request side for an engine of prompts (`self.engine`, set by the
    subclass's constructor); the subclass adds info, stats and step."""

    engine: PromptEngine

    def add(self, request: StageRequest) -> None:
        if request.streamed or request.prompt is None:
            raise ValueError("a diffusion stage takes a text prompt from the request")
        self.engine.add_request(request.request_id, request.prompt, request_params(request),
                                request.arrival_time)

    def feed(self, request_id: str, feed: StageFeed) -> None:
        raise ValueError("this diffusion stage takes no streamed input (no input edge)")

    def close_input(self, request_id: str) -> None:
        pass

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests
