"""A request's route through the graph, as the orchestrator keeps it (which stages it needs,
which are still open, its replica at each, what it asked for), and what its entry stages
take from the caller."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import Tensor

from omnistage.diffusion_params import DiffusionParams
from omnistage.outputs import RequestEvent
from omnistage.sampling_params import SamplingParams
from omnistage.stages import messages as m

Sink = Callable[[RequestEvent], None]


@dataclass(slots=True)
class Route:
    request_id: str
    sink: Sink
    needed: set[str]
    open_stages: set[str]
    finals: set[str]
    replicas: dict[str, int]                  # stage -> the replica serving this request there
    # each stage's AddRequest until the request starts there (output from it, or a chunk
    # routed to it): until then a dead replica's request can go to another one (_reroute)
    adds: dict[str, m.AddRequest] = field(default_factory=dict)
    work: dict[str, int] = field(default_factory=dict)   # stage -> steps asked (replicas.py)
    whole_text: dict[str, str] = field(default_factory=dict)
    chunk_idx: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, dict] = field(default_factory=dict)
    finish_reason: str | None = None
    want_progress: bool = False   # per-step progress events reach the sink only if asked


@dataclass(slots=True)
class EntryInputs:
    """What a request's entry stages take from the caller: the prompt (token ids, unless it is
    embeddings; text), and the tensors that go through the connector (a packed
    payloads.StageInputs: prompt embeddings, multimodal inputs)."""
    token_ids: list[int] | None
    prompt_text: str | None
    tensors: dict[str, Tensor]
    image: DiffusionParams | None = None     # what image the request makes (`request_image`)
    image_files: list[bytes] = field(default_factory=list)   # its input images' files


def request_image(params: dict[str, SamplingParams | DiffusionParams | None]
                  ) -> tuple[DiffusionParams | None, list[bytes]]:
    """The request's first DiffusionParams, its input image files detached, and those files:
    what a stage that is not a diffusion stage sees of the image the request makes (GLM-
    Image's AR stage writes its token grid for that size) and, if it takes them, of the
    images it starts from. (None, []) for a request without them."""
    given = next((p for p in params.values() if isinstance(p, DiffusionParams)), None)
    return (None, []) if given is None else given.detach_image()
