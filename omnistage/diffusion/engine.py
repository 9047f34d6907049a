"""The diffusion stage engine: step-level continuous batching of denoising requests.

Each request carries its own latents, schedule, step index and generator. Every `step()` takes
the compatible running requests (same latent shape), whatever step each is at, into one
transformer forward, advances each by one solver step, and decodes those that reached the end.
New requests join between steps; an abort takes effect before the next one.

A request whose text conditioning comes from an upstream stage (a split graph's text-encoder
stage; prompt None) is prepared at once (latents, schedule) and parked; `set_conditioning`
checks what arrived and lets it join the running requests. An abort frees it in either state.

    add(prompt) -------------------------------> running --step() x N--> decoded
    add(None) --> parked --set_conditioning()--^

    step():  group by batch key (oldest request's group first) -> velocity() once
             -> solver step per request -> done? decode -> DiffusionResult

A stage over several ranks (diffusion/parallel.py): this engine on rank 0 does all of the
above and, before each forward, shares a `StepPlan` (the batch, the requests the others do not
hold yet, those dropped); the engines of the other ranks `follow()` the plans, running the
same forwards and solver steps on their copies of the requests, and decode nothing.
`stop_followers()` (rank 0, at shutdown) ends their loops.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from PIL import Image
from torch import Tensor

from omnistage.diffusion.image_input import input_image
from omnistage.diffusion.lora import LoraAdapters, adapter_key, group_by_adapter
from omnistage.diffusion.memory import MemoryBudget, row_size
from omnistage.diffusion.parallel import FollowedRequest, StepPlan
from omnistage.diffusion.params import DiffusionParams, ImageRef
from omnistage.diffusion.pipeline import DiffusionPipeline
from omnistage.diffusion.request import DiffusionRequest
from omnistage.layers.groups import StageRanks, stage_ranks
from omnistage.outputs import StageMetrics
from omnistage.errors import InputError, StageError
from omnistage.payloads import Payload

logger = logging.getLogger(__name__)

OUT_OF_MEMORY = "out of memory"
PROFILE_PROMPT = "a 1"      # any pipeline's text takes it; the digits demo needs a digit


@dataclass(slots=True)
class DiffusionResult:
    request_id: str
    images: Tensor | Payload | None   # uint8 (num_images, H, W, C) once finished, or the
                                      # pipeline's Payload (DiffusionPipeline.decode)
    finished: bool
    progress: float
    error: StageError | None = None   # internal: its message says what failed
    metrics: StageMetrics | None = None


class DiffusionEngine:
    def __init__(self, pipeline: DiffusionPipeline, max_num_seqs: int = 16,
                 ranks: StageRanks | None = None, memory: MemoryBudget | None = None) -> None:
        """memory: the stage's budget (diffusion/memory.py); None: steps take up to
        max_num_seqs requests whatever their size."""
        self.pipeline = pipeline
        self.max_num_seqs = max_num_seqs
        self.memory = memory
        self.requests: OrderedDict[str, DiffusionRequest] = OrderedDict()   # running
        self.parked: dict[str, DiffusionRequest] = {}       # waiting for their conditioning
        self.num_steps_run = 0          # transformer forwards, all requests
        self.ranks = ranks or stage_ranks()
        self.followed: set[str] = set()     # rank 0: the requests the other ranks hold
        denoisers = pipeline.denoisers()      # LoRA on the first (diffusion/lora.py)
        self.lora = LoraAdapters(denoisers[0]) if denoisers else None

    def validate(self, prompt: str | None, params: DiffusionParams,
                 image: Image.Image | None = None) -> None:
        params.validate()
        self.pipeline.validate(prompt, params, image)

    def add_request(self, request_id: str, prompt: str | None, params: DiffusionParams,
                    arrival_time: float | None = None, parked: bool | None = None) -> None:
        """prompt None: the text conditioning comes from an upstream stage; the request waits
        for it (`set_conditioning`) after its latents and schedule are prepared. parked True
        with a prompt: the prompt is encoded here and the request still waits for what
        upstream sends (a pipeline with `text_with_upstream`: GLM-Image's visual tokens)."""
        if request_id in self.requests or request_id in self.parked:
            raise ValueError(f"request id {request_id!r} is already running")
        if prompt is None and not self.pipeline.splits_text:
            raise ValueError(f"{type(self.pipeline).__name__} encodes its own prompts: it "
                             "cannot take conditioning from an upstream stage")
        req = self._prepare(request_id, prompt, params)
        if self.memory is not None:
            self.memory.check(req)              # a request that alone cannot fit: refused
        if arrival_time is not None:
            req.arrival_time = arrival_time
        if (prompt is None) if parked is None else parked:
            self.parked[request_id] = req
        else:
            self.requests[request_id] = req

    def _prepare(self, request_id: str, prompt: str | None, params: DiffusionParams
                 ) -> DiffusionRequest:
        """A request checked and prepared (latents, schedule, conditioning), with its solver."""
        assert not isinstance(params.image, ImageRef), "the stage attaches the image file"
        image = input_image(params, None)    # decoded once, here: validate and prepare take it
        self.validate(prompt, params, image)
        self._ensure_lora(params)
        seed = params.seed if params.seed is not None else int(torch.seed() % 2**63)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        if prompt is None:
            latents, sigmas, cond = self.pipeline.prepare_latents(params, generator, image)
        else:
            latents, sigmas, cond = self.pipeline.prepare(prompt, params, generator, image)
        req = DiffusionRequest(request_id, prompt, params, latents, sigmas, cond, generator)
        return self._give_solver(req)

    def _ensure_lora(self, params: DiffusionParams) -> None:
        """The request's LoRA adapter held (loaded from its path on first use); InputError
        naming lora.name / lora.path."""
        if params.lora is None:
            return
        if self.lora is None:
            raise InputError(f"lora: {self.pipeline.label} has no transformer to adapt", "lora")
        in_use = frozenset(r.params.lora.name for r in (*self.requests.values(),
                                                        *self.parked.values())
                           if r.params.lora is not None)
        self.lora.ensure(params.lora, in_use)

    def profile_memory(self) -> None:
        """Start-up: the second step of a request at the pipeline's default size, measured,
        so the first admissions know its peak (the budget's fit then learns from every step).
        Skipped without a budget, over several ranks (the others would have to run it too),
        and for a pipeline that cannot prepare a request alone (conditioning from upstream,
        an input image required): there the first steps run one request each, measured."""
        pipeline = self.pipeline
        if self.memory is None or self.ranks.world_size > 1 or pipeline.text_with_upstream or (
                pipeline.splits_text and pipeline.prompt_encoder is None):
            return
        try:
            req = self._prepare("memory-profile", PROFILE_PROMPT,
                                DiffusionParams(num_inference_steps=2, seed=0))
        except ValueError as exc:
            logger.info("no start-up memory profile (%s): the first steps measure", exc)
            return
        with torch.inference_mode():
            self._denoise([req])     # the first forward allocates one-time workspaces
            self.memory.start()
            self._denoise([req])
        self.num_steps_run -= 2
        self.memory.record([req])
        logger.info("diffusion memory: %s", self.memory.describe(req))

    def set_conditioning(self, request_id: str, tensors: dict[str, Tensor]) -> None:
        """A parked request's text conditioning (prompt_embeds, ...): checked against its
        params by the pipeline; then the request runs from the next step."""
        req = self.parked.get(request_id)
        if req is None:
            if request_id in self.requests:
                raise ValueError(f"request {request_id!r} already has its conditioning")
            raise KeyError(f"request {request_id!r} is not waiting for conditioning")
        req.cond.update(self.pipeline.check_conditioning(tensors, req.params))
        req.conditioning_time = time.time()
        self.requests[request_id] = self.parked.pop(request_id)

    def is_parked(self, request_id: str) -> bool:
        return request_id in self.parked

    def abort(self, request_id: str) -> DiffusionRequest | None:
        req = self.requests.pop(request_id, None)
        return req if req is not None else self.parked.pop(request_id, None)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.parked)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests) + len(self.parked)

    def progress(self, request_id: str) -> float | None:
        req = self.requests.get(request_id) or self.parked.get(request_id)
        return None if req is None else req.progress

    def step(self) -> list[DiffusionResult]:
        if not self.requests:
            return []
        oldest = next(iter(self.requests.values()))
        batch = [r for r in self.requests.values()
                 if r.batch_key == oldest.batch_key][:self.max_num_seqs]
        if self.memory is not None:
            batch = self.memory.admit(batch)            # the others wait for a later step
        self._share_plan(batch)
        now = time.time()
        for r in batch:
            r.first_step_time = r.first_step_time or now
        failed = self._step_isolating(batch)
        results = [DiffusionResult(r.request_id, None, True, r.progress,
                                   StageError.internal(failed[r.request_id]))
                   for r in batch if r.request_id in failed]
        for rid in failed:
            del self.requests[rid]
        batch = [r for r in batch if r.request_id not in failed]
        for r in batch:
            if not r.is_done:  # a progress signal: one per request per step it took part in
                results.append(DiffusionResult(r.request_id, None, False, r.progress))
                continue
            del self.requests[r.request_id]
            self.followed.discard(r.request_id)        # the others drop it as they finish it
            images = self._decode(r)
            if isinstance(images, str):
                results.append(DiffusionResult(r.request_id, None, True, 1.0,
                                               StageError.internal(images)))
                continue
            done = time.time()
            metrics = StageMetrics(
                queue_time=r.first_step_time - r.arrival_time, num_steps=r.num_steps,
                num_steps_skipped=r.num_steps_skipped, denoise_time=done - r.first_step_time,
                # part of queue_time: upstream encoding
                conditioning_wait_time=None if r.conditioning_time is None
                else r.conditioning_time - r.arrival_time,
                ignored=tuple(self.pipeline.unused_params(r.params)))
            results.append(DiffusionResult(r.request_id, images, True, 1.0, metrics=metrics))
        return results

    def _decode(self, r: DiffusionRequest) -> Tensor | Payload | str:
        """A finished request's images, or why its decode failed (out of memory: the cached
        blocks go back once the exception is dropped)."""
        try:
            with torch.inference_mode():
                return self.pipeline.decode(self.pipeline.final_latents(r), r.params)
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, torch.OutOfMemoryError):
                return failure
        self._free_cache()
        return failure

    def _step_isolating(self, batch: list[DiffusionRequest]) -> dict[str, str]:
        """One denoising step for `batch` -> the requests that failed it, with their error. A
        step that raises (out of memory included) is run again per request that it had not
        advanced, so a request that breaks the forward, or alone does not fit, fails alone
        and the others take their step; a request whose latents are no longer finite after
        its step (guidance that overflows) fails alone. Over several ranks a raise is the
        stage's: the ranks ran the batch together."""
        start = {r.request_id: r.step_idx for r in batch}
        failure = self._measured_denoise(batch)
        if failure is None:
            return _non_finite(batch)
        if len(batch) == 1:
            return {batch[0].request_id: failure}
        failed: dict[str, str] = {}
        for r in batch:
            if r.step_idx > start[r.request_id]:
                continue                             # it took its step before the failure
            alone = self._denoise_or_error([r])
            if alone is not None:
                failed[r.request_id] = alone
        return failed | _non_finite([r for r in batch if r.request_id not in failed])

    def _measured_denoise(self, batch: list[DiffusionRequest]) -> str | None:
        """`_denoise_or_error`, its peak (or its running out of memory) taught to the budget."""
        if self.memory is None:
            return self._denoise_or_error(batch)
        self.memory.start()
        failure = self._denoise_or_error(batch)
        if failure is None:
            self.memory.record(batch)
        elif failure.startswith(OUT_OF_MEMORY):
            self.memory.record_oom(batch)
        return failure

    def _denoise_or_error(self, batch: list[DiffusionRequest]) -> str | None:
        """One step of `batch` -> None, or why it failed. Out of memory: the cached blocks
        go back to the device once the exception, whose traceback holds the step's
        activations, is dropped, so that the retries and the next steps find them free."""
        try:
            with torch.inference_mode():
                self._denoise(batch)
            return None
        except Exception as exc:
            if self.ranks.world_size > 1:
                raise
            if not isinstance(exc, torch.OutOfMemoryError):
                logger.exception("diffusion step failed for %d requests", len(batch))
                return f"{type(exc).__name__}: {exc}"
            failure = _oom_message(batch, exc)
        logger.error("%s", failure)
        self._free_cache()
        return failure

    def _free_cache(self) -> None:
        if self.memory is not None:
            self.memory.probe.free_cache()
        elif self.pipeline.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- several ranks ------------------------------------------------------------------

    def _share_plan(self, batch: list[DiffusionRequest]) -> None:
        """Rank 0, before the step's forward: tell the other ranks what to run."""
        if self.ranks.world_size == 1:
            return
        dropped = [rid for rid in self.followed if rid not in self.requests]
        new = [FollowedRequest.of(r) for rid, r in self.requests.items()
               if rid not in self.followed]
        self.followed = (self.followed - set(dropped)) | {f.request_id for f in new}
        self.ranks.share_plan(StepPlan([r.request_id for r in batch], new, dropped))

    def follow(self) -> None:
        """Ranks > 0: run rank 0's plans until it sends None (`stop_followers`)."""
        assert not self.ranks.is_leader, "rank 0 schedules; it does not follow"
        while (plan := self.ranks.share_plan()) is not None:
            self.run_plan(plan)

    def stop_followers(self) -> None:
        """Rank 0, at shutdown: end the other ranks' `follow` loops."""
        if self.ranks.world_size > 1 and self.ranks.is_leader:
            self.ranks.share_plan(None)

    def run_plan(self, plan: StepPlan) -> list[DiffusionRequest]:
        """A follower's step: the same batch as rank 0's, on this rank's copies. -> the
        requests it finished (and let go; rank 0 decodes them)."""
        for rid in plan.dropped:
            self.requests.pop(rid, None)
        for f in plan.new:
            self._ensure_lora(f.params)
            self.requests[f.request_id] = self._give_solver(f.request(self.pipeline.device))
        batch = [self.requests[rid] for rid in plan.batch]
        with torch.inference_mode():    # a failure ends this rank, and so its stage
            self._denoise(batch)
        done = [r for r in batch if r.is_done]
        for r in done:
            del self.requests[r.request_id]
        return done

    def _give_solver(self, req: DiffusionRequest) -> DiffusionRequest:
        """The pipeline's solver (flow-match Euler where it declares none) and a fresh state
        of it for the request's first step."""
        if self.pipeline.solver is not None:
            req.solver = self.pipeline.solver
        req.solver_state = req.solver.new_state()
        return req

    def _denoise(self, batch: list[DiffusionRequest]) -> None:
        """One solver step for every request of the batch, in one model call."""
        dev = self.pipeline.device
        counts = [r.latents.shape[0] for r in batch]
        latents = torch.cat([r.latents for r in batch]).to(dev)            # (R, ...)
        sigma = torch.cat([r.sigmas[r.step_idx].expand(n) for r, n in zip(batch, counts)])
        velocity = self._velocity(latents, sigma.to(dev), batch)
        self.num_steps_run += 1
        for r, v, x in zip(batch, velocity.split(counts), latents.split(counts)):
            r.latents = r.solver.step(v, x, r.sigmas, r.step_idx, r.solver_state).to(x.dtype)
            r.step_idx += 1

    def _velocity(self, latents: Tensor, sigma: Tensor, batch: list[DiffusionRequest]
                  ) -> Tensor:
        """The pipeline's velocity for the batch: one call per LoRA adapter (and scale) among
        its requests, those without one sharing the base call; the rows put back in place."""
        keys = [adapter_key(r.params.lora) for r in batch]
        groups = group_by_adapter(keys)
        if len(groups) == 1 and keys[0] is None:
            return self.pipeline.velocity(latents, sigma, batch)
        rows = torch.arange(latents.shape[0]).split([r.latents.shape[0] for r in batch])
        out = torch.empty_like(latents)
        for members in groups:
            idx = torch.cat([rows[i] for i in members]).to(latents.device)
            with self.lora.applied(*(keys[members[0]] or (None,))):
                out[idx] = self.pipeline.velocity(latents[idx], sigma[idx],
                                                  [batch[i] for i in members])
        return out


def _oom_message(batch: list[DiffusionRequest], exc: torch.OutOfMemoryError) -> str:
    """What a request failed by an out-of-memory step is told: alone, its own size."""
    rows = sum(r.latents.shape[0] for r in batch)
    who = ("this request alone" if len(batch) == 1
           else f"a step of {len(batch)} requests, this one among them,")
    detail = str(exc).splitlines()[0] if str(exc) else ""
    return (f"{OUT_OF_MEMORY}: {who} ({rows} image(s) of {row_size(batch[0])} latent "
            f"elements) did not fit the device's memory ({detail}): ask for fewer images or "
            "a smaller size, or raise the stage's memory_fraction")


def _non_finite(batch: list[DiffusionRequest]) -> dict[str, str]:
    """The requests whose latents hold inf or NaN after their step, with the error they fail
    with (one device sync for the batch)."""
    if not batch:
        return {}
    finite = torch.stack([r.latents.isfinite().all() for r in batch]).tolist()
    return {r.request_id: f"the latents are no longer finite after step {r.step_idx} of "
                          f"{r.num_steps} (inf or NaN): the request's parameters (guidance, "
                          "size, image) overflow the model"
            for r, ok in zip(batch, finite) if not ok}
