"""An autoregressive stage: the AR engine behind the stage interface. Model-specific stages
(Qwen3-Omni's thinker and talker, qwen3_omni.py) build on it.

Tensor parallelism: every rank's process builds the same stage (start-up runs the same
collectives in the same order on each: loading, memory profiling, graph captures, warm-ups);
rank 0 then serves requests and the others `follow` (ar/engine.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from omnistage.ar.engine import AREngine, ModelLoader, StepOutput
from omnistage.ar.inputs import StreamInput
from omnistage.configs.options import NoOptions, read_options
from omnistage.configs.schema import StageConfig
from omnistage.payloads import ConditionImages, HiddenRows, Payload, TokenDelta
from omnistage.stages.adapters import StageFeed
from omnistage.stages.interface import EngineStats, StageInfo, StageRequest, StageResult
from omnistage.outputs import StageMetrics


class ARStage:
    # the record of the stage's `ar.options` a subclass understands (configs/options.py)
    Options: ClassVar[type] = NoOptions

    def __init__(self, stage: StageConfig, model: str, device: str,
                 loader: ModelLoader | None = None) -> None:
        """`loader`: how to build the model (default: the registry's class for the
        checkpoint); a model-specific stage passes its component's."""
        self.options = read_options(self.Options, stage.ar.options,
                                    f"stage {stage.name!r}: ar.options")
        self.stage = stage
        self.defaults = stage.default_sampling()
        self.engine = AREngine(stage.ar_config(model, device), loader=loader)
        self.attached: dict[str, ConditionImages] = {}     # see attach
        self.prepare()
        # the decode graphs this stage's requests replay: captured now, not mid-serving
        self.engine.capture_decode_graphs(*self.decode_graph_variant())

    def follow(self) -> None:
        """A rank > 0 of a tensor-parallel stage: run rank 0's steps until it stops us."""
        self.engine.follow()

    def stop_followers(self) -> None:
        """Rank 0, at shutdown: end the other ranks' `follow`."""
        self.engine.stop_followers()

    def prepare(self) -> None:
        """A model-specific stage's set-up once the engine is built, before its decode graphs
        are captured (the talker: its code predictor's graphs)."""

    def decode_graph_variant(self) -> tuple[tuple[int, ...], bool]:
        """(hidden layers the stage's decodes emit, whether they are fed embeddings)."""
        return self.stage.ar.output_hidden_layers, False

    def add(self, request: StageRequest) -> None:
        params = request.params or self.defaults
        if self.stage.ar.output_hidden_layers and not params.output_hidden_layers:
            # what the downstream edges need is the stage's business, not the caller's
            params = replace(params, output_hidden_layers=self.stage.ar.output_hidden_layers)
        self.engine.add_request(request.request_id, request.prompt_token_ids, params,
                                request.prompt_embeds, prompt_open=request.streamed,
                                stream=StreamInput() if request.streamed else None)

    def attach(self, request_id: str, condition: ConditionImages) -> None:
        """What a model-specific stage derived from a request's input (GLM-Image: its
        condition images' visual tokens) that goes downstream with the request's first
        output, beside its tokens."""
        self.attached[request_id] = condition

    def feed(self, request_id: str, feed: StageFeed) -> None:
        self.engine.extend_request(request_id, feed.prompt_token_ids, feed.prompt_embeds,
                                   feed.close_prompt, feed.stream_embeds, feed.close_stream)

    def close_input(self, request_id: str) -> None:
        self.engine.extend_request(request_id, close_prompt=True, close_stream=True)

    def abort(self, request_id: str) -> None:
        self.attached.pop(request_id, None)
        self.engine.abort_request(request_id)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests

    def info(self) -> StageInfo:
        """The engine's limits and its KV cache, and what the model adds (`model_info`)."""
        e = self.engine
        cfg, layout, graphs = e.model_config, e.kv_layout, e.runner.graphs
        return StageInfo(
            max_model_len=e.max_model_len, vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
            num_kv_blocks=layout.num_blocks, kv_block_size=layout.block_size,
            kv_cache_gib=round(layout.num_blocks * layout.bytes_per_block / 2**30, 3),
            device=str(e.device), dtype=str(e.dtype).removeprefix("torch."),
            cuda_graphs=tuple(graphs.sizes) if graphs is not None else ()
        ).merged(self.model_info())

    def model_info(self) -> StageInfo:
        """What a model-specific stage adds to `info` (a talker's speakers)."""
        return StageInfo()

    def stats(self) -> EngineStats:
        e, bm = self.engine, self.engine.block_manager
        num_running = len(e.scheduler.running)
        return EngineStats(num_running, e.num_unfinished_requests - num_running,
                           bm.num_free_blocks, bm.num_blocks, e.num_computed_tokens_total,
                           bm.num_prefix_queries_tokens, bm.num_prefix_hit_tokens,
                           e.scheduler.num_preemptions)

    def step(self) -> list[StageResult]:
        return [self.result(out) for out in self.engine.step()]

    def result(self, out: StepOutput) -> StageResult:
        """One engine output as the stage's result: its tokens, hidden rows (and what was
        attached to the request), why it finished, its metrics."""
        payload = Payload(condition_images=self.attached.pop(out.request_id, None))
        if out.new_token_ids:
            payload.tokens = TokenDelta(list(out.new_token_ids))
        if out.hidden_states:
            payload.hidden = HiddenRows.from_start(out.hidden_states, out.hidden_start,
                                                   out.num_prompt_tokens)
        engine_metrics = None
        if out.metrics is not None:
            engine_metrics = StageMetrics(
                queue_time=out.metrics.queue_time,
                num_prompt_tokens=out.metrics.num_prompt_tokens,
                num_cached_tokens=out.metrics.num_cached_tokens,
                num_preemptions=out.metrics.num_preemptions)
        return StageResult(out.request_id, out.new_token_ids, out.text_delta, payload,
                           out.finished, out.finish_reason.value if out.finish_reason else None,
                           out.error, out.logprobs, engine_metrics)
