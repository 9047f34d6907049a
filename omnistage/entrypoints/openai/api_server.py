"""The OpenAI-compatible HTTP server: `build_app(engine, config)` makes the FastAPI app over an
`AsyncOmni` (`omnistage serve`, entrypoints/cli/serve.py, starts the engine and runs it under
uvicorn).

    client ─> CORS ─> metrics (status per route) ─> body deadline ─> body size limit ─> API key
          ─> routes
                                                                                  │
         serving_chat / _completions / _images / _speech ──> EngineClient ──> AsyncOmni
         speech_stream, realtime/ (the WebSockets) ───────────┘

Routes hold no engine logic: they check the model name and hand the parsed body to a serving
object. Every route exists whatever the model; one whose output the model cannot make answers
400 saying so. `/` is the playground page (playground.py; `--no-playground`: none), served
without the API key like /health; every other route needs the key when one is set (/metrics
too, unless `--open-metrics`). /health is 503 once a stage has no live replica (200,
"degraded", while some replica is down); /metrics is Prometheus text.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Callable

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from omnistage.entrypoints.openai.client import (DEFAULT_MAX_PENDING_PREP, DEFAULT_PREP_WORKERS,
                                                 EngineClient)
from omnistage.entrypoints.openai.errors import (bad_request, check_model,
                                                 install_error_handlers)
from omnistage.entrypoints.openai.json_body import StrictJSONRoute
from omnistage.entrypoints.openai.log_lines import log_stage_stats
from omnistage.entrypoints.openai.media import MediaLoader, MediaPolicy
from omnistage.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from omnistage.entrypoints.openai.middleware import (KEY_PROTOCOL, OPEN_PATHS,  # noqa: F401
                                                     OPEN_PREFIX, APIKeyCheck, BodyLimit,
                                                     CountRequests, add_middleware)
from omnistage.entrypoints.openai.playground import add_playground, capabilities
from omnistage.entrypoints.openai.prep_pool import PrepPool
from omnistage.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                                   CompletionRequest, CompletionResponse,
                                                   ErrorResponse, ImageGenerationRequest,
                                                   ImagesResponse, ModelCapabilities,
                                                   ModelCard, ModelList)
from omnistage.entrypoints.openai.protocol_speech import (SpeechBatchRequest,
                                                          SpeechBatchResponse, SpeechRequest,
                                                          VoiceCard, VoiceList)
from omnistage.entrypoints.openai.realtime.connection import RealtimeLimits
from omnistage.entrypoints.openai.realtime.routes import add_realtime_routes
from omnistage.entrypoints.openai.serving_chat import ChatServing
from omnistage.entrypoints.openai.serving_completions import CompletionServing
from omnistage.entrypoints.openai.serving_images import ImageServing, edit_form_schema
from omnistage.entrypoints.openai.serving_speech import SpeechServing
from omnistage.entrypoints.openai.serving_videos import VideoServing
from omnistage.entrypoints.openai.slow_clients import ConnectionLimits
from omnistage.entrypoints.openai.speech_stream import SpeechStream
from omnistage.entrypoints.openai.video_params import VideoLimits
from omnistage.entrypoints.openai.video_routes import add_video_routes
from omnistage.entrypoints.openai.video_store import (VideoStore, default_videos_dir,
                                                      server_scope)
from omnistage.entrypoints.openai.voices import (VoiceStore, default_voices_dir, upload,
                                                 voice_form_schema)

if TYPE_CHECKING:
    from omnistage.engine.async_omni import AsyncOmni
    from omnistage.stages.messages import StageStats

logger = logging.getLogger(__name__)
DEMO_MODEL_NAME = "omnistage-demo"
_VIDEO_LIMITS = VideoLimits()
_REALTIME_LIMITS = RealtimeLimits()
_MEDIA = MediaPolicy()
_CONNECTIONS = ConnectionLimits()
ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503)}


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model: str | None = None
    served_model_name: str | None = None      # None: the model as given, or "omnistage-demo"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    open_metrics: bool = False                # /metrics without the API key (for scrapers)
    max_queue: int = 256                      # requests in flight before 429
    allowed_media_dirs: tuple[str, ...] = ()
    allow_remote_media: bool = False
    max_body_bytes: int = 64 << 20
    max_media_bytes: int = 20 << 20
    # what a request's media may take before anything is decoded (media.py; docs/deployment.md)
    max_image_pixels: int = _MEDIA.max_image_pixels
    max_request_pixels: int = _MEDIA.max_request_pixels
    max_audio_seconds: float = _MEDIA.max_audio_seconds
    max_input_video_frames: int = _MEDIA.max_video_frames
    max_media_parts: int = _MEDIA.max_media_parts
    max_message_parts: int = _MEDIA.max_message_parts
    # the preparation pool (prep_pool.py): threads, and requests queued or running there
    prep_workers: int = DEFAULT_PREP_WORKERS
    max_pending_prep: int = DEFAULT_MAX_PENDING_PREP
    # slow clients (slow_clients.py): header and body deadlines, connections per address
    header_timeout_s: float = _CONNECTIONS.header_timeout_s
    body_timeout_s: float = _CONNECTIONS.body_timeout_s
    max_connections_per_client: int = _CONNECTIONS.max_connections_per_client
    allowed_origins: tuple[str, ...] = ()     # CORS; empty: no CORS headers
    chat_template: str | None = None          # template text (the CLI reads the file)
    # what a chat answers with when a request names no `modalities`; empty: OpenAI's default
    # (text; image for an image model). ("text", "audio") is vLLM-Omni's default for omni models
    default_modalities: tuple[str, ...] = ()
    log_level: str = "info"
    stats_timeout_s: float = 2.0
    stats_log_interval_s: float = 10.0        # a stage's stats line at most this often; 0: none
    voices_dir: str | None = None             # uploaded voices; None: voices.default_voices_dir()
    # /v1/videos (models that make video): jobs and files, None: default_videos_dir(); limits
    videos_dir: str | None = None
    videos_scope: str | None = None           # whose jobs there; None: video_store.server_scope
    max_video_jobs: int = _VIDEO_LIMITS.max_jobs
    max_video_frames: int = _VIDEO_LIMITS.max_frames
    max_video_size: int = _VIDEO_LIMITS.max_size
    max_videos_disk_bytes: int = _VIDEO_LIMITS.max_disk_bytes
    max_running_videos: int = _VIDEO_LIMITS.max_running
    enable_playground: bool = True            # the page at / (playground.py)
    # /v1/realtime sessions (models that hear and speak)
    realtime_max_buffer_bytes: int = _REALTIME_LIMITS.max_buffer_bytes
    realtime_max_turn_s: float = _REALTIME_LIMITS.max_turn_s
    realtime_idle_timeout_s: float = _REALTIME_LIMITS.idle_timeout_s

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError(f"max_queue={self.max_queue}: must be >= 1")
        if self.max_body_bytes < 1 or self.max_media_bytes < 1:
            raise ValueError("max_body_bytes / max_media_bytes: must be >= 1")
        for name in ("max_video_jobs", "max_video_frames", "max_video_size",
                     "max_videos_disk_bytes", "max_running_videos", "max_image_pixels",
                     "max_request_pixels", "max_audio_seconds", "max_input_video_frames",
                     "max_media_parts", "max_message_parts", "prep_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        self.realtime_limits            # checks its values
        self.connection_limits
        if self.max_pending_prep < self.prep_workers:
            raise ValueError(f"max_pending_prep={self.max_pending_prep}: must be >= "
                             f"prep_workers ({self.prep_workers})")
        for d in self.allowed_media_dirs:
            if not Path(d).is_dir():
                raise ValueError(f"allowed_media_dirs: {d} is not a folder")
        for m in self.default_modalities:
            if m not in ("text", "audio", "image"):
                raise ValueError(f"default_modalities: {m!r} is not one of text, audio, image")

    @property
    def video_limits(self) -> VideoLimits:
        return VideoLimits(self.max_video_jobs, self.max_video_frames, self.max_video_size,
                           self.max_videos_disk_bytes, self.max_running_videos)

    @property
    def realtime_limits(self) -> RealtimeLimits:
        return RealtimeLimits(self.realtime_max_buffer_bytes, self.realtime_max_turn_s,
                              self.realtime_idle_timeout_s)

    @property
    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(self.header_timeout_s, self.body_timeout_s,
                                self.max_connections_per_client)

    @property
    def media_policy(self) -> MediaPolicy:
        return MediaPolicy(tuple(Path(d) for d in self.allowed_media_dirs),
                           self.allow_remote_media, self.max_media_bytes,
                           max_image_pixels=self.max_image_pixels,
                           max_request_pixels=self.max_request_pixels,
                           max_audio_seconds=self.max_audio_seconds,
                           max_video_frames=self.max_input_video_frames,
                           max_media_parts=self.max_media_parts,
                           max_message_parts=self.max_message_parts)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model or DEMO_MODEL_NAME

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> ServerConfig:
        names = {f.name for f in fields(cls)}
        kw = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
        if isinstance(kw.get("default_modalities"), str):     # "text,audio" from a flag
            kw["default_modalities"] = [m.strip() for m in kw["default_modalities"].split(",")
                                        if m.strip()]
        for n in ("allowed_media_dirs", "allowed_origins", "default_modalities"):
            if n in kw:
                kw[n] = tuple(kw[n])
        return cls(**kw)


# ---- the app ---------------------------------------------------------------------------------

def build_app(engine: AsyncOmni, args: ServerConfig | argparse.Namespace) -> FastAPI:
    """The app: routes about the server (health, metrics, models), the generation routes, then
    the middleware (API key, body limit, request counts, CORS)."""
    config = args if isinstance(args, ServerConfig) else ServerConfig.from_namespace(args)
    metrics = ServerMetrics(config.model_name,
                            {s.name: s.final for s in engine.graph.stages if s.final})
    client = EngineClient(engine, config.max_queue, metrics,
                          PrepPool(config.prep_workers, config.max_pending_prep))
    media = MediaLoader(config.media_policy)
    # the jobs' folder and database exist only for a model that makes video; its jobs are
    # this server's (a folder may be shared: video_store.server_scope)
    store = VideoStore(Path(config.videos_dir or default_videos_dir()), config.videos_scope
                       or server_scope(config.model_name, config.model, config.host,
                                       config.port, machine=config.videos_dir is None)
                       ) if engine.video is not None else None
    videos = VideoServing(client, media, engine.video, store, config.video_limits,
                          config.model_name)
    app = FastAPI(title="omnistage", version="0.1.0",
                  description="OpenAI-compatible server for omni-modality models",
                  lifespan=_lifespan(client, config, videos))
    app.router.route_class = StrictJSONRoute     # one JSON policy for every route (json_body)
    app.state.client = client
    app.state.config = config
    install_error_handlers(app)
    _add_server_routes(app, client, config, metrics, functools.partial(
        capabilities, client, engine.speech is not None, engine.video is not None, app))
    _add_generation_routes(app, client, config, media)
    _add_speech_routes(app, SpeechServing(client, media, engine.speech, VoiceStore(
        Path(config.voices_dir) if config.voices_dir else default_voices_dir(),
        engine.speech.voices if engine.speech else ())), config.model_name)
    add_video_routes(app, videos)
    if config.enable_playground:
        add_playground(app)
    add_realtime_routes(app, client, config.model_name, config.realtime_limits)
    add_middleware(app, config.api_key, config.open_metrics, config.max_body_bytes,
                   config.body_timeout_s, config.allowed_origins, metrics)
    return app


def _lifespan(client: EngineClient, config: ServerConfig, videos: VideoServing
              ) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan: while it serves, a task logs each stage's stats line (at most every
    `stats_log_interval_s`, when something changed there; log_lines.py), and the video
    workers run the queued jobs."""
    def fetch() -> dict[str, StageStats]:
        return client.stage_stats(config.stats_timeout_s) if client.is_healthy else {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = None
        if config.stats_log_interval_s > 0:
            task = asyncio.create_task(log_stage_stats(fetch, config.stats_log_interval_s))
        videos.start()
        try:
            yield
        finally:
            await videos.stop()
            client.close()
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    return lifespan


def _add_server_routes(app: FastAPI, client: EngineClient, config: ServerConfig,
                       metrics: ServerMetrics, caps: Callable[[], ModelCapabilities]) -> None:
    """/health, /metrics, /v1/models (with what the model can do: playground.capabilities)."""
    name, started = config.model_name, int(time.time())

    @app.get("/health", responses=ERRORS)
    async def health() -> dict[str, object]:
        """200 while every stage has a live replica ("degraded" with the reason when some
        replica is down), 503 once a stage has none."""
        client.check_healthy()
        reason = client.degraded_reason
        status: dict[str, object] = ({"status": "degraded", "reason": reason} if reason
                                     else {"status": "ok"})
        return {**status, "replicas": client.replica_status()}

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        stats = None
        if client.is_healthy:
            try:
                stats = await run_in_threadpool(client.stage_stats, config.stats_timeout_s)
            except TimeoutError as exc:
                logger.warning("metrics: %s", exc)
        body = metrics.render(stats, client.is_healthy, client.num_in_flight,
                              client.replica_status())
        return Response(body, media_type=CONTENT_TYPE)

    def card() -> ModelCard:
        foreign = client.foreign_backend
        root = name if config.served_model_name else config.model   # the path stays hidden
        return ModelCard(id=name, created=started, root=root,
                         max_model_len=client.max_model_len, modalities=sorted(client.outputs),
                         capabilities=caps(), native=not foreign, **foreign)

    @app.get("/v1/models", responses=ERRORS)
    async def list_models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}", responses=ERRORS)
    async def get_model(model_id: str) -> ModelCard:
        check_model(model_id, name)
        return card()


def _add_generation_routes(app: FastAPI, client: EngineClient, config: ServerConfig,
                           media: MediaLoader) -> None:
    """/v1/chat/completions, /v1/completions, /v1/images/generations and /v1/images/edits."""
    name = config.model_name
    chat = ChatServing(client, media, name, config.chat_template,
                       config.default_modalities)
    completions = CompletionServing(client, name)
    images = ImageServing(client, media, name)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
                 responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model, name)
        return await chat.create(body, request)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model, name)
        return await completions.create(body, request)

    @app.post("/v1/images/generations", responses=ERRORS)
    async def images_generations(body: ImageGenerationRequest, request: Request
                                 ) -> ImagesResponse:
        check_model(body.model, name)
        return await images.generate(body, request)

    @app.post("/v1/images/edits", responses=ERRORS, openapi_extra={"requestBody": {
        "required": True, "content": {"multipart/form-data": {"schema": edit_form_schema()}}}})
    async def images_edits(request: Request) -> ImagesResponse:
        # the form is read by the serving object: `image` and `image[]`, unknown fields -> 400
        return await images.edit(request)


def _add_speech_routes(app: FastAPI, speech: SpeechServing, name: str) -> None:
    """/v1/audio/speech (+ /batch, and the WebSocket /stream) and /v1/audio/voices: every one
    answers 400 model_not_speech unless the model's family declares speech."""

    @app.post("/v1/audio/speech", responses=ERRORS, response_class=Response)
    async def create_speech(body: SpeechRequest, request: Request) -> Response:
        check_model(body.model, name)
        return await speech.create(body, request)

    @app.post("/v1/audio/speech/batch", responses=ERRORS)
    async def create_speech_batch(body: SpeechBatchRequest, request: Request
                                  ) -> SpeechBatchResponse:
        check_model(body.model, name)
        return await speech.batch(body, request)

    @app.websocket("/v1/audio/speech/stream")
    async def speech_stream(ws: WebSocket) -> None:
        await SpeechStream(ws, speech, name).run()

    @app.get("/v1/audio/voices", responses=ERRORS)
    async def list_voices() -> VoiceList:
        speech.require_speech()
        return VoiceList(data=await run_in_threadpool(speech.voices.cards))

    @app.post("/v1/audio/voices", responses=ERRORS, openapi_extra={"requestBody": {
        "required": True, "content": {"multipart/form-data": {"schema": voice_form_schema()}}}})
    async def upload_voice(request: Request) -> VoiceCard:
        if not speech.require_speech().cloning:
            raise bad_request("this model does not clone voices: uploads are for cloning "
                              "models", "audio", "cloning_not_supported")
        return await upload(speech.voices, request)

    @app.delete("/v1/audio/voices/{voice}", responses=ERRORS)
    async def delete_voice(voice: str) -> dict[str, object]:
        speech.require_speech()
        await run_in_threadpool(speech.voices.delete, voice)
        return {"name": voice, "deleted": True}
