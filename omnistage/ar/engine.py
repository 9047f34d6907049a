"""The autoregressive stage engine: `step()` = schedule, execute, update.

It owns one model, its KV cache, a scheduler and a runner, and speaks in per-step deltas
(`StepOutput`): new token ids, new text, new hidden states, and whether the request finished.
It knows nothing of processes or of other stages.

Tensor parallelism (issue 18): every rank of the stage builds the engine alike (with the
stage's ranks current, layers/groups.py), each over its shard of the model and its KV cache.
Rank 0 schedules and steps; the others call `follow`, which runs the plans rank 0's runner
shares until `stop_followers`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Hashable

import torch
from torch import Tensor

from omnistage.ar import shadows
from omnistage.ar.detokenizer import IncrementalDetokenizer
from omnistage.ar.hidden_rows import HiddenRowCache
from omnistage.ar.inputs import MultimodalInput, PromptInput, StreamInput, check_request
from omnistage.ar.kv_cache import BlockManager, KVCacheLayout
from omnistage.ar.memory import size_kv_cache
from omnistage.ar.model_runner import ModelRunner, PendingStep, RunnerOutput, capture_key
from omnistage.ar.quantize import quantize_model
from omnistage.ar.scheduler import ScheduledBatch, Scheduler
from omnistage.ar.sequence import FinishReason, Sequence, SequenceStatus, StepOutput
from omnistage.configs.schema import ARConfig
from omnistage.errors import StageError
from omnistage.layers.groups import stage_ranks
from omnistage.models.loader import load_model, resolve_model_path
from omnistage.outputs import RequestMetrics
from omnistage.sampling_params import SamplingParams
from omnistage.utils.device import resolve_device, resolve_dtype
from omnistage.utils import trace
from omnistage.utils.host import to_device
from omnistage.utils.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

ModelLoader = Callable[[Path, torch.device, "torch.dtype | None"], tuple]


class AREngine:
    def __init__(self, config: ARConfig, loader: ModelLoader | None = None) -> None:
        """`loader(path, device, dtype) -> (model, ModelConfig, hf_config)` loads a model that
        is one component of a larger checkpoint (default: the architecture's model class)."""
        self.config = config
        self.ranks = stage_ranks()
        if self.ranks.world_size != self.ranks.tp.world_size:
            raise ValueError(f"an AR stage splits over tensor parallelism only: ulysses, ring "
                             f"and cfg-parallel sizes must be 1, got {self.ranks.sizes}")
        self.device = resolve_device(config.device)
        path = resolve_model_path(config.model)
        # what other stages of this process (backend inproc, built one at a time) hold
        before = (torch.cuda.memory_allocated(self.device) if self.device.type == "cuda"
                  else 0)
        self.model, self.model_config, self.hf_config = (loader or load_model)(
            path, self.device, resolve_dtype(config.dtype, path, self.device))
        quantize_model(self.model, config.quantization, self.device)
        self.dtype = next(self.model.parameters()).dtype
        self.tokenizer = load_tokenizer(Path(config.tokenizer) if config.tokenizer else path)

        sched = config.scheduler
        self.kv_layout: KVCacheLayout
        self.kv_layout, self.max_model_len = size_kv_cache(
            self.model, self.model_config, config, self.device, self.dtype, before)
        self.block_manager = BlockManager(self.kv_layout.num_blocks, self.kv_layout.block_size,
                                          config.kv_cache.enable_prefix_caching)
        self.scheduler = Scheduler(sched, self.block_manager, self.max_model_len)
        self.hidden_rows = HiddenRowCache(self.block_manager)
        self.runner = ModelRunner(self.model, self.kv_layout, self.device, self.dtype,
                                  config.attention_backend, config.seed,
                                  max_num_seqs=sched.max_num_seqs,
                                  max_model_len=self.max_model_len,
                                  enforce_eager=config.enforce_eager,
                                  max_graph_tokens=min(config.max_graph_tokens,
                                                       sched.max_num_batched_tokens))
        eos = set(self.model_config.eos_token_ids)
        if (self.tokenizer is not None and self.tokenizer.eos_token_id is not None
                and self.model.stops_at_tokenizer_eos):
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.runner.eos_token_ids = self.eos_token_ids
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._parked: dict[str, Sequence] = {}  # streamed requests with no input yet
        # async scheduling: a decode step launched but not read back, and its batch
        self._inflight: tuple[ScheduledBatch, PendingStep] | None = None
        self.num_computed_tokens_total = 0  # tokens run through the model, all requests
        self._followers_stopped = False

    def capture_decode_graphs(self, capture_layers: tuple[int, ...] = (),
                              embeds: bool = False) -> None:
        """Capture now, at start-up, every batch-size bucket of the decode CUDA graph variant
        this stage's steps will replay: requests emitting `capture_layers` (their
        output_hidden_layers), decodes fed embeddings (stream rows, a feedback hook) or token
        ids. Otherwise the first step to use a bucket of it captures it, up to a second
        inside serving. The prefill graphs take the same layers, for prompts of token ids and
        of embeddings both (a multimodal prompt's audio rows, a talker's prompt: its first
        such request must not pay for the captures). Nothing to do without graphs (CPU,
        enforce_eager, a model that can't be captured)."""
        graphs = self.runner.graphs
        if graphs is None:
            return
        layers = capture_key(capture_layers)            # as ModelRunner.execute keys a step
        top = max(layers, default=0)
        if top > self.model_config.num_hidden_layers:
            raise ValueError(f"capture_layers asks for layer {top}, the model has "
                             f"{self.model_config.num_hidden_layers}")
        # a step's embedding rows are the model's embeddings in the engine's dtype (validate
        # checks the hidden size of what requests bring)
        fed = (self.model_config.hidden_size, self.dtype) if embeds else None
        graphs.capture_variant(layers, fed)
        if self.runner.prefill_graphs is not None:   # prompts of token ids, of embeddings
            prompt_fed = (self.model_config.hidden_size, self.dtype)
            for variant in (None, prompt_fed):
                self.runner.prefill_graphs.capture_variant(layers, variant)

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        """The model's token embeddings (T,) -> (T, hidden) outside a step (a stage building a
        prompt's embeddings as it arrives, on rank 0): the other ranks join in."""
        return self.runner.embed(input_ids)

    # -- the other ranks of a tensor-parallel stage ------------------------------------------
    def follow(self) -> None:
        """A rank > 0: run rank 0's plans (the forward passes of its steps) until
        `stop_followers` ends them."""
        assert not self.ranks.is_leader, "rank 0 steps; the other ranks follow"
        while (plan := self.ranks.share_plan()) is not None:
            self.runner.follow(plan)  # type: ignore[arg-type]

    def stop_followers(self) -> None:
        """Rank 0, at shutdown: end the other ranks' `follow` (once)."""
        if self.ranks.is_leader and self.ranks.world_size > 1 and not self._followers_stopped:
            self._followers_stopped = True
            self.ranks.share_plan(None)

    # -- requests ----------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int] | None, params: SamplingParams,
                 prompt_embeds: Tensor | None = None) -> None:
        """Raise ValueError naming the problem; nothing is scheduled for a bad request."""
        check_request(prompt_token_ids, params, prompt_embeds, self.model_config,
                      self.max_model_len, has_tokenizer=self.tokenizer is not None)

    def add_request(self, request_id: str, prompt_token_ids: list[int] | None,
                    params: SamplingParams, prompt_embeds: Tensor | None = None,
                    arrival_time: float | None = None, prompt_open: bool = False, *,
                    stream: StreamInput | None = None, mm: MultimodalInput | None = None,
                    cache_ids: list[int] | None = None) -> None:
        """Queue a request. With `prompt_open` its prompt may still grow (and may be empty now:
        the request is parked until `extend_request` brings input); with an open `stream` its
        decodes wait for upstream rows (see Sequence). Token ids given together with
        `prompt_embeds` (same length) are kept as the prompt's real ids (for penalties and for
        what downstream stages see). `mm`: a multimodal prompt's rotary positions and
        deepstack features (ar/inputs.py). `cache_ids`: what the prefix cache hashes in
        place of the ids of an embeddings prompt (PromptInput.cache_ids)."""
        if request_id in self.scheduler.requests or request_id in self._parked:
            raise ValueError(f"request id {request_id!r} is already running")
        empty = prompt_embeds is None and not prompt_token_ids
        if not (prompt_open and empty):
            self.validate(prompt_token_ids, params, prompt_embeds)
        else:
            self.validate([0], params)
        real_ids = (prompt_embeds is not None and prompt_token_ids is not None
                    and len(prompt_token_ids) == prompt_embeds.shape[0])
        if prompt_embeds is not None and not real_ids:
            prompt_token_ids = [0] * prompt_embeds.shape[0]  # placeholders (see Sequence)
        if mm is not None and not prompt_open:
            mm.check(len(prompt_token_ids or []))
        if cache_ids is not None and (prompt_open or len(cache_ids) != len(prompt_token_ids or [])):
            raise ValueError(f"cache_ids has {len(cache_ids)} entries for a prompt of "
                             f"{len(prompt_token_ids or [])} tokens (and only a closed prompt "
                             "takes them)")
        seq = Sequence(request_id=request_id, prompt_token_ids=list(prompt_token_ids or []),
                       sampling_params=params, eos_token_ids=self.eos_token_ids,
                       prompt=PromptInput(prompt_embeds, real_ids, prompt_open, cache_ids),
                       stream=stream, mm=mm)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        if empty:
            self._parked[request_id] = seq
        else:
            self.scheduler.add(seq)

    def extend_request(self, request_id: str, prompt_token_ids: list[int] | None = None,
                       prompt_embeds: Tensor | None = None, close_prompt: bool = False,
                       stream_embeds: Tensor | None = None, close_stream: bool = False,
                       stream_pad: Tensor | None = None, mm: MultimodalInput | None = None
                       ) -> None:
        """Feed streamed input to a request added with prompt_open / an open stream (stream_pad:
        added to decodes past the stream's end once it is closed; mm: the whole prompt's
        multimodal input, given with its last part)."""
        seq = self._parked.get(request_id) or self.scheduler.requests.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not running")
        if stream_pad is not None and seq.stream is not None:
            seq.stream.pad = stream_pad
        if mm is not None:
            seq.mm = mm
        hidden = self.model_config.hidden_size
        if prompt_token_ids or prompt_embeds is not None:
            try:
                if prompt_embeds is not None:
                    seq.prompt.add_embeds(prompt_embeds, hidden, bool(seq.prompt_token_ids))
                    seq.prompt_token_ids.extend([0] * prompt_embeds.shape[0])
                else:
                    seq.prompt.check_ids()
                    self.validate(list(prompt_token_ids), seq.sampling_params)
                    seq.prompt_token_ids.extend(prompt_token_ids)
            except ValueError as exc:
                raise ValueError(f"request {request_id!r}: {exc}") from None
            if seq.num_prompt_tokens >= self.max_model_len:
                raise ValueError(f"prompt has {seq.num_prompt_tokens} tokens, but the model's "
                                 f"maximum length is {self.max_model_len}")
        if seq.mm is not None and not (seq.prompt.open and not close_prompt):
            seq.mm.check(seq.num_prompt_tokens)
        if stream_embeds is not None:
            if seq.stream is None:
                raise ValueError(f"request {request_id!r}: it takes no input stream")
            try:
                seq.stream.extend(stream_embeds, hidden)
            except ValueError as exc:
                raise ValueError(f"request {request_id!r}: {exc}") from None
        if close_prompt:
            seq.prompt.open = False
        if close_stream and seq.stream is not None:
            seq.stream.open = False
        if request_id in self._parked and seq.num_prompt_tokens > 0:
            del self._parked[request_id]
            self.scheduler.add(seq)
        elif request_id in self._parked and not seq.prompt.open:
            raise ValueError(f"request {request_id!r}: prompt closed while empty")

    def add_shadow(self, request_id: str, key: Hashable, rows: Tensor) -> None:
        """Give a queued request a shadow context (ar/shadows.py: run with it, read and fed
        by the model's feedback hook, freed with it) that first computes `rows` (n, hidden)."""
        seq = self._parked.get(request_id) or self.scheduler.requests.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not running")
        shadows.add_shadow(seq, key, rows.to(self.device, self.dtype),
                           self.model_config.hidden_size)

    def abort_request(self, request_id: str) -> StepOutput | None:
        seq = self._parked.pop(request_id, None)
        if seq is not None:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
            return self._finish_output(seq, [])
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        return self._finish_output(seq, [])

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._parked)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests) + len(self._parked)

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule, execute, update. With async scheduling (decode batches replayed from CUDA
        graphs, see `_launch_ahead`) the next step is launched before this one's tokens are
        read back, so the host's work between steps overlaps the device's:

            sync:   [host: schedule N | launch N] [device: N] [host: read N, update, outputs]
            async:  launch N | launch N+1 (fed N's tokens on the device) | read N, update,
                    outputs | (next call) launch N+2 | read N+1 ...

        Tokens are the same either way; a sequence that finishes at step N wastes its row of
        step N+1."""
        w0 = time.time()
        inflight, self._inflight = self._inflight, None
        if inflight is not None and all(s.is_finished for s in inflight[0].seqs):
            inflight = None                  # all aborted meanwhile: nothing to read
        if inflight is None:
            batch = self.scheduler.schedule()
            if batch.is_empty:
                return []
            if not self._pipelinable(batch.seqs):
                try:
                    result = self.runner.execute(batch)
                except Exception as exc:  # a failing batch fails its requests, not the engine
                    return self._fail(batch, exc)
                outputs = self._process(batch, result)
                if trace.enabled():
                    _trace_batch("ar.step", w0, batch)
                return outputs
            try:
                pending = self.runner.launch_decode(batch)
            except Exception as exc:
                return self._fail(batch, exc)
        else:
            batch, pending = inflight
        self._inflight = self._launch_ahead(batch, pending)
        try:
            result = self.runner.resolve(pending)
        except Exception as exc:
            self._inflight = None
            return self._fail(batch, exc)
        outputs = self._process(batch, result)
        if trace.enabled():
            _trace_batch("ar.step.async", w0, batch)
        return outputs

    def _pipelinable(self, seqs: list[Sequence]) -> bool:
        """Whether a decode step of these sequences can run with its tokens left on the device
        until the step after it is launched: a graph-replayed batch of plain decodes (no
        hidden-state outputs, streamed or fed-back inputs). Penalties and min_tokens count
        the unread token on the device (Sampler.sample's `pending`)."""
        graphs = self.runner.graphs
        if not (self.config.async_scheduling and graphs is not None
                and self.model.feedback is None):
            return False
        for seq in seqs:
            if (seq.num_computed_tokens < seq.num_prompt_tokens or seq.prompt.open
                    or seq.stream is not None or seq.output_embeds or seq.shadows
                    or seq.sampling_params.output_hidden_layers):
                return False
        batch = ScheduledBatch(seqs, [1] * len(seqs))
        return graphs.can_run(batch) and not graphs.needs_embeds(batch)

    def _launch_ahead(self, batch: ScheduledBatch, pending: PendingStep
                      ) -> tuple[ScheduledBatch, PendingStep] | None:
        """Launch the step after `pending` (not read yet) for the same sequences, fed its
        tokens on the device, if the scheduler has nothing else to run instead
        (`Scheduler.schedule_ahead`) and no parked request waits for input."""
        if self._parked:
            return None
        ahead = self.scheduler.schedule_ahead(batch, self._pipelinable)
        if ahead is None:
            return None
        nxt, keep = ahead
        tokens = pending.token_ids
        if len(keep) != len(batch.seqs):
            tokens = tokens[to_device(keep, tokens.device)]
        try:
            return nxt, self.runner.launch_decode(nxt, tokens)
        except Exception:           # the step runs the ordinary way instead
            logger.exception("launching a decode step ahead failed")
            return None

    def _fail(self, batch: ScheduledBatch, exc: Exception) -> list[StepOutput]:
        """A failing batch fails its requests, not the engine; but over several ranks the
        ranks may no longer agree (or one is gone): the failure is the stage's, raised."""
        if self.ranks.world_size > 1:
            raise exc
        logger.error("model step failed for %d requests", len(batch.seqs), exc_info=exc)
        outs = []
        for seq in batch.seqs:
            if seq.is_finished or seq.owner is not None:    # a shadow ends with its owner
                continue
            self.scheduler.finish(seq, FinishReason.ERROR)
            outs.append(self._finish_output(
                seq, [], error=StageError.internal(f"{type(exc).__name__}: {exc}")))
        return outs

    def _process(self, batch: ScheduledBatch, result: RunnerOutput) -> list[StepOutput]:
        """Update the scheduler with a step's results -> the requests' deltas. Sequences that
        finished before the step was read (async scheduling: at the step before, or aborted)
        are skipped."""
        done_before = {id(s) for s in batch.seqs if s.is_finished}
        self.num_computed_tokens_total += sum(
            n for s, n in zip(batch.seqs, batch.num_new_tokens) if id(s) not in done_before)
        finished = set(id(s) for s in self.scheduler.update(batch, result.sampled))

        outputs: list[StepOutput] = []
        for i, seq in enumerate(batch.seqs):
            if id(seq) in done_before:
                continue
            token = result.sampled[i]
            new_ids = [] if token is None else [token]
            hidden = result.hidden_states[i]
            if hidden is not None:       # after a prefix hit: its kept rows first
                hidden = self.hidden_rows.restore(seq, hidden)
                self.hidden_rows.record(seq, hidden, seq.num_hidden_emitted
                                        - next(iter(hidden.values())).shape[0])
            if not new_ids and hidden is None:
                continue
            text, stop_hit = "", False
            detok = self._detokenizer(seq)
            if detok is not None and new_ids:
                text, stop_hit = detok.step(new_ids)
                if stop_hit and id(seq) not in finished:
                    self.scheduler.finish(seq, FinishReason.STOP)
                    finished.add(id(seq))
            logprobs = [result.logprobs[i]] if result.logprobs[i] is not None else None
            extra = result.extras[i] if result.extras is not None else None
            if id(seq) in finished:
                if detok is not None and not stop_hit:
                    text += detok.finish()
                out = self._finish_output(seq, new_ids, text=text)
                out.logprobs, out.hidden_states = logprobs, hidden
                if not self.model.keeps_last_extras:
                    extra = None    # never fed back: kept only where the model says they are real
            else:
                out = StepOutput(seq.request_id, new_ids, text, logprobs, hidden)
            out.extra = extra
            if hidden is not None:
                out.hidden_start = seq.num_hidden_emitted - next(iter(hidden.values())).shape[0]
            out.num_prompt_tokens = seq.num_prompt_tokens
            outputs.append(out)
        return outputs

    def _detokenizer(self, seq: Sequence) -> IncrementalDetokenizer | None:
        """Made at the first token, when the prompt (context for decoding) is complete."""
        detok = self._detokenizers.get(seq.request_id)
        if detok is None and seq.sampling_params.detokenize and self.tokenizer is not None:
            context = [] if seq.has_embeds else seq.prompt_token_ids
            detok = IncrementalDetokenizer(self.tokenizer, context, seq.sampling_params)
            self._detokenizers[seq.request_id] = detok
        return detok

    def _finish_output(self, seq: Sequence, new_ids: list[int], text: str = "",
                       error: StageError | None = None) -> StepOutput:
        self._detokenizers.pop(seq.request_id, None)
        self.hidden_rows.drop(seq.request_id)
        metrics = RequestMetrics(
            arrival_time=seq.arrival_time, first_scheduled_time=seq.first_scheduled_time,
            first_token_time=seq.first_token_time, finished_time=time.monotonic(),
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens, num_preemptions=seq.num_preemptions)
        return StepOutput(seq.request_id, new_ids, text, finish_reason=seq.finish_reason,
                          error=error, metrics=metrics)


def _trace_batch(name: str, start: float, batch: ScheduledBatch) -> None:
    """A step's span: its prefill (more than one new token) and decode rows, by request."""
    prefill = {s.request_id: n for s, n in zip(batch.seqs, batch.num_new_tokens) if n > 1}
    trace.span(name, start, num_decode=len(batch.seqs) - len(prefill), prefill=prefill)
