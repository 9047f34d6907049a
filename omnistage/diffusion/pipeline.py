"""What a diffusion pipeline is to the engine and its stage: `DiffusionPipeline`, the one
contract. Its class attributes (with defaults) are the complete list of what a pipeline may
declare; the engine and the stages read them directly and probe nothing by name.

The methods are the phases of a diffusers `__call__`, split so the engine can batch the
denoising across requests at different steps, and so the text encoders can run in a stage of
their own:

    1. encode(prompts, params) -> text conditioning per request     (PromptEncoder, batched)
    2. prepare_latents(params, generator) -> initial latents, schedule, other conditioning
    3. velocity(latents, sigmas, requests) -> model output for a batch           (every step)
    4. decode(final_latents(request), params) -> images, uint8 (n, H, W, C)

`prepare(prompt, params, generator)` is 1 + 2 for one request: what a single-stage graph runs.
In a split graph (configs/*_split.yaml) a text-encoder stage runs 1 alone, batched over
requests, and the diffusion stage, loaded without text encoders, runs 2 at once and parks the
request until its conditioning arrives (`check_conditioning`), then denoises it:

    single stage:   prompt --[ encode + prepare_latents | velocity x N | decode ]--> images
    split:          prompt --[ encode ]--conditioning--> [ prepare_latents ... decode ]-->

A pipeline without text encoders of its own (the digits demo) has only `prepare`
(`splits_text` False). The image pipelines share diffusion/latent_pipeline.py; CFG branches
and CFG-parallel ranks are diffusion/cfg.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, ClassVar, Hashable, Protocol

import torch
from PIL import Image
from torch import Tensor

from omnistage.configs.options import NoOptions
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.request import DiffusionRequest
from omnistage.diffusion.solvers import Solver
from omnistage.payloads import Payload

# `DiffusionPipeline.backend` of a pipeline that the engine steps (every native port); the
# generic diffusers adapter says "diffusers" (diffusion/diffusers_pipeline.py) and gets a
# stage of its own (stages/diffusers.py)
NATIVE = "native"


class PromptEncoder(Protocol):
    """A pipeline's text encoders and tokenizers: the text part of its `prepare`."""

    device: torch.device

    def validate(self, prompt: str, params: DiffusionParams) -> None: ...

    def encode(self, prompts: list[str], params: list[DiffusionParams]
               ) -> list[dict[str, Tensor]]:
        """One conditioning dict per request (prompt_embeds, and pooled / negative_prompt_embeds
        as the pipeline needs them for these params), all requests in one batched call."""


class DiffusionPipeline:
    """The base of every diffusion pipeline (diffusion/pipelines/*, the diffusers adapter, the
    toy pipelines of omnistage/testing). A subclass declares what it can do by overriding the
    class attributes below, and implements the phases it has."""

    # ---- what a pipeline declares ------------------------------------------------------
    label: ClassVar[str] = "diffusion pipeline"            # for messages
    backend: ClassVar[str] = NATIVE     # "diffusers": the generic adapter, run whole per call
    # the axes its ranks can split (diffusion/parallel.py; of configs/schema.AXES) and the
    # key of the head count in its transformer's config.json (heads divide by ulysses x tp)
    parallel_axes: ClassVar[tuple[str, ...]] = ()
    heads_key: ClassVar[str] = "num_attention_heads"
    # the record of its stage's `diffusion.options` (configs/options.py), handed to
    # `configure` before the first request (SD3's skip_layer_guidance)
    Options: ClassVar[type] = NoOptions
    graphable: ClassVar[bool] = False   # its denoisers' forward can replay as a CUDA graph
    # a stage compiles the denoisers' blocks by default on CUDA, one rank (measured faster:
    # benchmarks/diffusion_variants.py)
    compile_default: ClassVar[bool] = False
    # from_pretrained takes `offload` (its transformer's blocks in host memory: offload.py)
    supports_offload: ClassVar[bool] = False
    max_input_images: ClassVar[int] = 1   # input images an edit may bring (the front door's)
    # its text encoding may run in a stage of its own (load_prompt_encoder, prepare_latents,
    # check_conditioning are implemented)
    splits_text: ClassVar[bool] = False
    # in a split graph it still encodes the request's prompt beside what its input edge
    # brings (GLM-Image: the glyph text, beside the AR stage's visual tokens)
    text_with_upstream: ClassVar[bool] = False

    # ---- state every pipeline has ------------------------------------------------------
    device: torch.device
    prompt_encoder: PromptEncoder | None = None   # None: none loaded (or none at all)
    solver: Solver | None = None        # the engine steps every request with it; None: Euler

    @classmethod
    def from_pretrained(cls, path: str | Path | None, component: str, device: torch.device,
                        dtype: torch.dtype | None, text_encoders: bool = True
                        ) -> DiffusionPipeline:
        """A checkpoint folder, in `dtype` (None: the checkpoint's). text_encoders False (a
        `splits_text` pipeline only): none is loaded (a split graph's diffusion stage)."""
        raise NotImplementedError

    def validate(self, prompt: str | None, params: DiffusionParams,
                 image: Image.Image | None = None) -> None:
        """ValueError naming the field. prompt None: the conditioning comes from upstream.
        image: the request's input image, decoded by the engine (None: `params.image`'s
        header is read, if any). A pipeline that takes several (`max_input_images`) decodes
        `params.extra_images` itself."""
        raise NotImplementedError

    def prepare(self, prompt: str, params: DiffusionParams, generator: torch.Generator,
                image: Image.Image | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """-> initial latents, sigmas, conditioning. image: as in `validate` (None:
        `params.image` is decoded here, if any)."""
        raise NotImplementedError

    def velocity(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        """latents (R, ...) are the requests' rows in order, sigmas (R,) their current sigma;
        each request brings its conditioning, params and step-cache state."""
        raise NotImplementedError

    def final_latents(self, request: DiffusionRequest) -> Tensor:
        """A finished request's latents as `decode` takes them: the solver's, unless the
        pipeline puts something back (Wan2.2 TI2V's fixed first frame)."""
        return request.latents

    def decode(self, latents: Tensor, params: DiffusionParams) -> Tensor | Payload:
        """-> uint8 images (n, H, W, C), or a video pipeline's frames (n, F, H, W, 3), or a
        Payload of what else it makes beside them (LTX-2: the video with its frame rate and
        its sound track, `Payload(video=Video(...), audio=AudioChunk(...))`)."""
        raise NotImplementedError

    def denoisers(self) -> list[torch.nn.Module]:
        """The networks a stage compiles, quantizes (`quantization: fp8`) and graphs: the
        transformer(s) that `velocity` runs every step."""
        return []

    def unused_params(self, params: DiffusionParams) -> dict[str, str]:
        """The fields of `params` this pipeline accepts and does not use, and why (where
        diffusers only warns); they reach the client as ignored. By default the schedule
        fields only a pipeline that declares them uses (Wan's boundary_ratio, flow_shift)."""
        return {name: "this pipeline's schedule follows its checkpoint"
                for name in ("boundary_ratio", "flow_shift")
                if getattr(params, name) is not None}

    def configure(self, options: object) -> None:
        """Its stage's `diffusion.options`, an `Options` record (none by default)."""

    def use_cuda_graphs(self, max_graphs: int = 8) -> None:
        """Replay the denoisers' forward from CUDA graphs (a stage's `cuda_graphs` option)."""
        raise ValueError(f"{self.label}: its transformer's forward is not captured as a "
                         "CUDA graph (cuda_graphs: false)")

    # ---- a `splits_text` pipeline's phases -------------------------------------------------

    @classmethod
    def load_prompt_encoder(cls, path: str | Path, device: torch.device,
                            dtype: torch.dtype | None) -> PromptEncoder:
        """The text encoders alone, for a text-encoder stage."""
        raise NotImplementedError(f"{cls.label}: encodes its own prompts")

    def prepare_latents(self, params: DiffusionParams, generator: torch.Generator,
                        image: Image.Image | None = None
                        ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Initial latents, sigmas and the conditioning that is not text (e.g. the grid)."""
        raise NotImplementedError(f"{self.label}: encodes its own prompts")

    def check_conditioning(self, tensors: dict[str, Tensor], params: DiffusionParams
                           ) -> dict[str, Tensor]:
        """An encoder's output for this request, checked, on the device in the model dtype."""
        raise NotImplementedError(f"{self.label}: encodes its own prompts")


def encode_with_negatives(encode_texts: Callable[[list[str]], list[Tensor]],
                          prompts: list[str], params: list[DiffusionParams],
                          guided: Callable[[DiffusionParams], bool]) -> list[dict[str, Tensor]]:
    """Every prompt, and the negative prompt of each request that `guided` says runs a
    negative branch, in one `encode_texts` call: -> per request {"prompt_embeds"} plus
    "negative_prompt_embeds" where guided (an unset negative prompt encodes as "")."""
    texts = []
    for prompt, p in zip(prompts, params, strict=True):
        texts += [prompt, p.negative_prompt or ""] if guided(p) else [prompt]
    states = iter(encode_texts(texts))
    out = []
    for p in params:
        cond = {"prompt_embeds": next(states)}
        if guided(p):
            cond["negative_prompt_embeds"] = next(states)
        out.append(cond)
    return out


def forward_by_key(latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest],
                   key: Callable[[DiffusionRequest], Hashable],
                   forward: Callable[[Tensor, Tensor, list[DiffusionRequest]], Tensor]) -> Tensor:
    """`forward(latents, sigmas, requests)` once per set of requests whose `key` agrees (what
    one transformer call needs shared: the latent grid's rope ids, say, when sizes such as
    32x64 and 64x32 pack to the same token count and so share an engine batch), the rows
    put back in place. latents (R, ...), one request's rows after the other's."""
    groups: dict[Hashable, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(key(r), []).append(i)
    if len(groups) == 1:
        return forward(latents, sigmas, requests)
    rows = torch.arange(latents.shape[0]).split([r.latents.shape[0] for r in requests])
    out = torch.empty_like(latents)
    for members in groups.values():
        idx = torch.cat([rows[i] for i in members]).to(latents.device)
        out[idx] = forward(latents[idx], sigmas[idx], [requests[i] for i in members])
    return out


def check_conditioning(tensors: dict[str, Tensor], expected: dict[str, tuple[int, int]],
                       device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
    """Text conditioning from an upstream stage: exactly the `expected` keys, each with
    (ndim, last dim) as given; returned on `device` in `dtype`. ValueError naming the key."""
    missing = sorted(expected.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"conditioning: expected tensors {sorted(expected)}, got "
                         f"{sorted(tensors)} (missing {missing}, unexpected {unexpected})")
    out = {}
    for key, (ndim, last) in expected.items():
        t = tensors[key]
        if t.dim() != ndim or t.shape[-1] != last or not t.is_floating_point():
            raise ValueError(f"conditioning[{key!r}]: expected a float tensor of {ndim} "
                             f"dimensions, the last {last}, got {t.dtype} {tuple(t.shape)}")
        out[key] = t.to(device, dtype)
    return out


def compile_blocks(model: torch.nn.Module, backend: str = "inductor") -> int:
    """torch.compile each block of a diffusion transformer (every member of its ModuleLists),
    in place; the model's own glue (embeddings, rope, padding) stays eager. dynamic=True: the
    batch (requests and CFG rows) and caption lengths change from step to step. Returns the
    number of blocks compiled. A stage turns it on with `diffusion: {compile: true}` (or a
    backend name)."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            for i, block in enumerate(module):
                if not isinstance(block, torch.nn.ModuleList):
                    module[i] = torch.compile(block, backend=backend, dynamic=True)
                    count += 1
    return count


def uncompile_blocks(model: torch.nn.Module) -> None:
    """Undo compile_blocks: the eager blocks back in their ModuleLists (benchmarks time a
    model both ways)."""
    from torch._dynamo.eval_frame import OptimizedModule   # what torch.compile wraps a block in

    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            for i, block in enumerate(module):
                module[i] = block._orig_mod if isinstance(block, OptimizedModule) else block
