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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Callable

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from omnistage.configs.lora_modules import parse_lora_modules
from omnistage.configs.server import ServerSettings
from omnistage.entrypoints.openai.client import EngineClient
from omnistage.entrypoints.openai.errors import (bad_request, check_model,
                                                 install_error_handlers)
from omnistage.entrypoints.openai.ignored_header import IgnoredHeader
from omnistage.entrypoints.openai.image_files import add_image_file_routes
from omnistage.entrypoints.openai.json_body import StrictJSONRoute
from omnistage.entrypoints.openai.log_lines import log_stage_stats
from omnistage.entrypoints.openai.lora_adapters import LoraAdapters, add_lora_routes
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
ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503)}


@dataclass(frozen=True, slots=True)
class ServerConfig(ServerSettings):
    """The server's settings (configs/server.py: the fields, each with its `serve` flag) and
    the limit records the running server builds from them."""

    def __post_init__(self) -> None:
        ServerSettings.__post_init__(self)
        self.realtime_limits            # checks its values
        self.connection_limits

    @property
    def video_limits(self) -> VideoLimits:
        return VideoLimits(self.max_video_jobs, self.max_video_frames, self.max_video_size,
                           self.max_videos_disk_bytes, self.max_running_videos)

    @property
    def realtime_limits(self) -> RealtimeLimits:
        return RealtimeLimits(self.realtime_max_buffer_bytes, self.realtime_max_turn_s,
                              self.realtime_idle_timeout_s,
                              server_vad=not self.vllm_omni_answers,   # vLLM-Omni's: off
                              resume_grace_s=self.realtime_resume_grace_s)

    @property
    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(self.header_timeout_s, self.body_timeout_s,
                                self.max_connections_per_client)

    @property
    def media_policy(self) -> MediaPolicy:
        # vLLM fetches media URLs by default: so do we where we answer as vLLM-Omni (still
        # public addresses only, remote_media.py)
        return MediaPolicy(tuple(Path(d) for d in self.allowed_media_dirs),
                           self.allow_remote_media or self.vllm_omni_answers,
                           self.max_media_bytes,
                           max_image_pixels=self.max_image_pixels,
                           max_request_pixels=self.max_request_pixels,
                           max_audio_seconds=self.max_audio_seconds,
                           max_video_frames=self.max_input_video_frames,
                           max_media_parts=self.max_media_parts,
                           max_message_parts=self.max_message_parts)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model or DEMO_MODEL_NAME


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
    loras = LoraAdapters(config.model_name, "image" in client.outputs)   # lora_adapters.py
    loras.load_modules(parse_lora_modules(config.lora_modules))
    _add_server_routes(app, client, config, metrics, functools.partial(
        capabilities, client, engine.speech is not None, engine.video is not None, app), loras)
    voices = VoiceStore(Path(config.voices_dir) if config.voices_dir else default_voices_dir(),
                        engine.speech.voices if engine.speech else ())
    _add_generation_routes(app, client, config, media, loras,
                           voices if engine.speech and engine.speech.cloning else None)
    add_lora_routes(app, loras, ERRORS)
    _add_speech_routes(app, SpeechServing(client, media, engine.speech, voices),
                       config.model_name)
    add_video_routes(app, videos)
    if config.enable_playground:
        add_playground(app)
    add_realtime_routes(app, client, config.model_name, config.realtime_limits)
    app.add_middleware(IgnoredHeader)      # X-Omnistage-Ignored: what the request had ignored
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
                       metrics: ServerMetrics, caps: Callable[[], ModelCapabilities],
                       loras: LoraAdapters) -> None:
    """/health, /metrics, /v1/models (with what the model can do: playground.capabilities;
    then the LoRA adapters loaded, as vLLM lists them)."""
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
        return ModelList(data=[card(), *loras.cards()])

    @app.get("/v1/models/{model_id:path}", responses=ERRORS)
    async def get_model(model_id: str) -> ModelCard:
        adapter = loras.card(model_id)
        if adapter is not None:
            return adapter
        check_model(model_id, name)
        return card()


def _add_generation_routes(app: FastAPI, client: EngineClient, config: ServerConfig,
                           media: MediaLoader, loras: LoraAdapters,
                           voices: VoiceStore | None = None) -> None:
    """/v1/chat/completions, /v1/completions, /v1/images/generations and /v1/images/edits
    (`model` naming a loaded LoRA adapter chooses it on the chat and image routes)."""
    name = config.model_name
    chat = ChatServing(client, media, name, config.chat_template,
                       config.default_modalities, vllm_omni_answers=config.vllm_omni_answers,
                       video_limits=config.video_limits, voices=voices)
    completions = CompletionServing(client, name)
    images = ImageServing(client, media, name, loras=loras)
    add_image_file_routes(app, images.files)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
                 responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.create(loras.with_adapter(body), request)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model, name)
        return await completions.create(body, request)

    @app.post("/v1/images/generations", responses=ERRORS)
    async def images_generations(body: ImageGenerationRequest, request: Request
                                 ) -> ImagesResponse:
        return await images.generate(loras.with_adapter(body), request)

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

    @app.post("/v1/audio/voices", responses=ERRORS, response_model=VoiceCard, openapi_extra={
        "requestBody": {"required": True, "content": {"multipart/form-data": {
            "schema": voice_form_schema()}}}})
    async def upload_voice(request: Request) -> VoiceCard | Response:  # Response: vLLM-Omni's
        if not speech.require_speech().cloning:
            raise bad_request("this model does not clone voices: uploads are for cloning "
                              "models", "audio", "cloning_not_supported")
        return await upload(speech.voices, request)

    @app.delete("/v1/audio/voices/{voice}", responses=ERRORS)
    async def delete_voice(voice: str) -> dict[str, object]:
        speech.require_speech()
        await run_in_threadpool(speech.voices.delete, voice)
        return {"name": voice, "deleted": True}
