"""What a diffusion pipeline provides to the engine: the phases of a diffusers `__call__`, split
so the engine can batch the denoising across requests at different steps, and so the text
encoders can run in a stage of their own.

    1. encode(prompts, params) -> text conditioning per request     (PromptEncoder, batched)
    2. prepare_latents(params, generator) -> initial latents, schedule, other conditioning
    3. velocity(latents, sigmas, requests) -> model output for a batch           (every step)
    4. decode(latents, params) -> images, uint8 (n, H, W, C); a pipeline whose last latents
       are not the solver's (Wan2.2 TI2V's fixed first frame) has `final_latents(request)`,
       which the engine calls for them

`prepare(prompt, params, generator)` is 1 + 2 for one request: what a single-stage graph runs.
In a split graph (configs/*_split.yaml) a text-encoder stage runs 1 alone, batched over
requests, and the diffusion stage, loaded without text encoders, runs 2 at once and parks the
request until its conditioning arrives (`check_conditioning`), then denoises it:

    single stage:   prompt --[ encode + prepare_latents | velocity x N | decode ]--> images
    split:          prompt --[ encode ]--conditioning--> [ prepare_latents ... decode ]-->

A pipeline without text encoders of its own (the digits demo) has only `prepare`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Hashable, Protocol, TypeGuard

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from omnistage.diffusion.image_input import output_size
from omnistage.diffusion.params import DiffusionParams, check_size
from omnistage.diffusion.solvers import flow_match_euler as solver
from omnistage.diffusion.request import DiffusionRequest
from omnistage.layers.graph_capture import ShapeGraphs
from omnistage.layers.groups import stage_ranks


class DiffusionPipeline(Protocol):
    device: torch.device

    def validate(self, prompt: str | None, params: DiffusionParams,
                 image: Image.Image | None = None) -> None:
        """ValueError naming the field. prompt None: the conditioning comes from upstream.
        image: the request's input image, decoded by the engine (None: `params.image`'s
        header is read, if any). A pipeline that takes several (`max_input_images`, default
        1, which the stage reports to the front door) decodes `params.extra_images` itself."""

    def prepare(self, prompt: str, params: DiffusionParams, generator: torch.Generator,
                image: Image.Image | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """image: as in `validate` (None: `params.image` is decoded here, if any)."""

    def velocity(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        """latents (R, ...) are the requests' rows in order, sigmas (R,) their current sigma;
        each request brings its conditioning, params and step-cache state."""

    def decode(self, latents: Tensor, params: DiffusionParams) -> Tensor: ...


class PromptEncoder(Protocol):
    """A pipeline's text encoders and tokenizers: the text part of its `prepare`."""

    device: torch.device

    def validate(self, prompt: str, params: DiffusionParams) -> None: ...

    def encode(self, prompts: list[str], params: list[DiffusionParams]
               ) -> list[dict[str, Tensor]]:
        """One conditioning dict per request (prompt_embeds, and pooled / negative_prompt_embeds
        as the pipeline needs them for these params), all requests in one batched call."""


class SplitPipeline(DiffusionPipeline, Protocol):
    """A pipeline whose text encoding may run in its own stage."""

    prompt_encoder: PromptEncoder | None       # None: loaded without text encoders

    @classmethod
    def load_prompt_encoder(cls, path: str, device: torch.device, dtype: torch.dtype | None
                            ) -> PromptEncoder: ...

    def prepare_latents(self, params: DiffusionParams, generator: torch.Generator,
                        image: Image.Image | None = None
                        ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Initial latents, sigmas and the conditioning that is not text (e.g. the grid)."""

    def check_conditioning(self, tensors: dict[str, Tensor], params: DiffusionParams
                           ) -> dict[str, Tensor]:
        """An encoder's output for this request, checked, on the device in the model dtype."""


def is_split_pipeline(cls: type) -> TypeGuard[type[SplitPipeline]]:
    """Whether `cls` implements `SplitPipeline` (its text encoding may run in another stage)."""
    return all(hasattr(cls, name) for name in
               ("load_prompt_encoder", "prepare_latents", "check_conditioning"))


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


class GraphedTransformer:
    """A pipeline's `transformer` forward, replayed from CUDA graphs once `use_cuda_graphs` is
    called (a stage's `options: {cuda_graphs: ...}`): what the image pipelines and Wan share.
    The pipeline sets `label` (for messages), `transformer`, and `graphable` True when the
    forward reads nothing but its arguments' device memory (layers/graph_capture.py)."""

    label: str
    transformer: torch.nn.Module
    graphable = False       # the transformer's forward can be a CUDA graph (`use_cuda_graphs`)
    # a stage compiles the transformer's blocks by default on CUDA (benchmarks/
    # diffusion_variants.py measured the compiled blocks faster than the eager path)
    compile_default = False
    graphs: ShapeGraphs | None = None

    def use_cuda_graphs(self, max_graphs: int = 8) -> None:
        """Replay the transformer's forward from CUDA graphs, one per (batch, latent, caption)
        shape seen twice (layers/graph_capture.py ShapeGraphs); step-cached forwards, whose
        blocks run or not per request, stay eager. A stage's `options: {cuda_graphs: ...}`."""
        if not self.graphable:
            raise ValueError(f"{self.label}: its transformer's forward is not captured as a "
                             "CUDA graph (cuda_graphs: false)")
        self.graphs = ShapeGraphs(self.transformer, max_graphs)

    def run_transformer(self, *args: object, step_cache: object = None, **kwargs: object
                        ) -> Tensor:
        """The transformer's forward: from a CUDA graph when they are on and no step cache
        is asked for."""
        if self.graphs is not None and step_cache is None:
            return self.graphs(*args, **kwargs)
        return self.transformer(*args, step_cache=step_cache, **kwargs)


class LatentPipelineBase(GraphedTransformer):
    """What the FLUX, Z-Image and Qwen-Image pipelines share around their model-specific
    phases (`prepare_latents`, `check_conditioning`, `velocity`, `decode_float`): the size
    rule, the request checks, prepare = encode + prepare_latents, and the uint8 decode.

    A subclass sets `label` (for messages), its network classes, `max_size`, `packed` (2x2
    latent patches packed into the channels of one token, FLUX / Qwen-Image; else the
    transformer patches them itself, Z-Image), `default_size` (pixels per side; None: 128
    latent pixels, 1024 px with an 8x VAE), `check_text_params(prompt, params)` and the
    `parallel_axes` its transformer and velocity split along (diffusion/parallel.py)."""

    label: str
    transformer_cls: type
    vae_cls: type
    prompt_encoder_cls: type
    max_size: int = 2048
    packed: bool = True
    default_size: int | None = None
    parallel_axes: tuple[str, ...] = ()
    heads_key = "num_attention_heads"        # in the transformer's config.json

    def __init__(self, transformer: torch.nn.Module, vae: torch.nn.Module,
                 prompt_encoder: PromptEncoder | None, scheduler: solver.FlowMatchEulerConfig,
                 device: torch.device) -> None:
        """prompt_encoder None: the conditioning comes from an upstream text-encoder stage."""
        self.transformer = transformer.to(device).eval()
        self.vae = vae.to(device).eval()
        self.prompt_encoder = prompt_encoder
        self.scheduler = scheduler
        self.device = device
        self.cfg_ranks = stage_ranks().cfg      # CFG-parallel: branch c runs on rank c
        self.dtype = next(transformer.parameters()).dtype
        self.vae_scale_factor = vae.cfg.downscale                  # 8 for all three
        self.multiple = self.vae_scale_factor * 2                  # pixels per token side
        channels = transformer.cfg.in_channels
        self.num_channels_latents = channels // 4 if self.packed else channels
        if self.default_size is None:
            self.default_size = 128 * self.vae_scale_factor   # latent pixels, as diffusers
        how = "packing" if self.packed else "patches"
        self.size_rule = f"VAE factor {self.vae_scale_factor} x 2x2 {how}"

    @staticmethod
    def check_text_params(prompt: str | None, params: DiffusionParams) -> None:
        raise NotImplementedError

    @classmethod
    def from_pretrained(cls, path: str | Path, component: str, device: torch.device,
                        dtype: torch.dtype | None, text_encoders: bool = True):
        """A diffusers folder: transformer/, vae/, the text encoders, scheduler/, in `dtype`
        (None: the transformer's). text_encoders False: none is loaded (a split graph's
        diffusion stage)."""
        path = _pipeline_folder(path)
        transformer = cls.transformer_cls.from_pretrained(path / "transformer", device, dtype)
        dtype = dtype or next(transformer.parameters()).dtype
        vae = cls.vae_cls.from_pretrained(path / "vae", device, dtype)
        prompt_encoder = (cls.prompt_encoder_cls.from_pretrained(path, device, dtype)
                          if text_encoders else None)
        scheduler = solver.FlowMatchEulerConfig.from_json(
            path / "scheduler" / "scheduler_config.json")
        return cls(transformer, vae, prompt_encoder, scheduler, device)

    @classmethod
    def load_prompt_encoder(cls, path: str | Path, device: torch.device,
                            dtype: torch.dtype | None) -> PromptEncoder:
        """The text encoders alone, for a text-encoder stage."""
        return cls.prompt_encoder_cls.from_pretrained(_pipeline_folder(path), device, dtype)

    def _size(self, params: DiffusionParams, image: Image.Image | None = None
              ) -> tuple[int, int]:
        """As asked; else the input image's size (rounded down; the decoded image's, or its
        file's header's); else the default."""
        return output_size(params.height, params.width,
                           image if image is not None else params.image, self.multiple,
                           self.default_size)

    def validate(self, prompt: str | None, params: DiffusionParams,
                 image: Image.Image | None = None) -> None:
        """prompt None: encoded by an upstream stage (which checked it)."""
        self.check_text_params(prompt, params)
        check_size(*self._size(params, image), self.multiple, self.max_size, self.size_rule)

    def prepare(self, prompt: str, params: DiffusionParams, generator: torch.Generator,
                image: Image.Image | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Encode the prompt(s), then the latents: a single-stage graph's request."""
        if self.prompt_encoder is None:
            raise ValueError(f"this {self.label} stage loads no text encoder: its conditioning "
                             "comes from an upstream text-encoder stage")
        (encoded,) = self.prompt_encoder.encode([prompt], [params])
        latents, sigmas, cond = self.prepare_latents(params, generator, image)  # type: ignore
        return latents, sigmas, {**self.check_conditioning(encoded, params),  # type: ignore
                                 **cond}

    def latent_schedule(self, params: DiffusionParams, float32_linspace: bool = False,
                        image: Image.Image | None = None
                        ) -> tuple[int, int, int, int, Tensor]:
        """A request's pixel size (height, width), its latent grid (h, w: two latent rows and
        columns per `multiple` pixels) and the schedule shifted by its token count."""
        height, width = self._size(params, image)
        h, w = 2 * (height // self.multiple), 2 * (width // self.multiple)  # type: ignore
        sigmas = self.shifted_sigmas(h, w, params.num_inference_steps, float32_linspace)
        return height, width, h, w, sigmas

    def shifted_sigmas(self, h: int, w: int, num_steps: int, float32_linspace: bool = False
                       ) -> Tensor:
        """The flow-match schedule of an (h, w) latent: linspace(1, 1/N, N) (numpy float64, or
        torch float32 as Z-Image builds it), shifted by the image's packed token count."""
        cfg = self.scheduler                                               # type: ignore
        mu = solver.calculate_shift((h // 2) * (w // 2), cfg.base_image_seq_len,
                                    cfg.max_image_seq_len, cfg.base_shift, cfg.max_shift)
        base = (torch.linspace(1.0, 1 / num_steps, num_steps).tolist() if float32_linspace
                else np.linspace(1.0, 1 / num_steps, num_steps))
        return solver.make_sigmas(cfg, num_steps, mu=mu, sigmas=base)[0]

    def decode(self, latents: Tensor, params: DiffusionParams) -> Tensor:
        """-> uint8 (n, H, W, 3)."""
        images = self.decode_float(latents, params)                        # type: ignore
        return (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()

    @property
    def vae_dtype(self) -> torch.dtype:
        return next(self.vae.parameters()).dtype


def compile_blocks(model: torch.nn.Module, backend: str = "inductor") -> int:
    """torch.compile each block of a diffusion transformer (every member of its ModuleLists),
    in place; the model's own glue (embeddings, rope, padding) stays eager. dynamic=True: the
    batch (requests and CFG rows) and caption lengths change from step to step. Returns the
    number of blocks compiled. A stage turns it on with `options: {compile: true}` (or a
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
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            for i, block in enumerate(module):
                module[i] = getattr(block, "_orig_mod", block)


def _pipeline_folder(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(f"{path}: no model_index.json (not a diffusers pipeline)")
    return path
