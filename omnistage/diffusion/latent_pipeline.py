"""What the image pipelines share: the transformer's forward replayed from CUDA graphs
(`GraphedTransformer`, also Wan's) and, for FLUX, FLUX.2, Z-Image, Qwen-Image, SD3 and
GLM-Image, the size rule, the request checks, prepare = encode + prepare_latents and the uint8
decode around their model-specific phases (`LatentPipelineBase`). The contract they implement
is diffusion/pipeline.py's `DiffusionPipeline`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from omnistage.diffusion.image_input import output_size
from omnistage.diffusion.params import DiffusionParams, check_size
from omnistage.diffusion.pipeline import DiffusionPipeline, PromptEncoder
from omnistage.diffusion.solvers import flow_match_euler as solver
from omnistage.diffusion import lora, offload
from omnistage.diffusion.offload import offload_blocks
from omnistage.layers.graph_capture import ShapeGraphs
from omnistage.layers.groups import stage_ranks


class GraphedTransformer(DiffusionPipeline):
    """A pipeline's `transformer` forward, replayed from CUDA graphs once `use_cuda_graphs` is
    called (a stage's `diffusion: {cuda_graphs: ...}`): what the image pipelines share. The
    pipeline sets `transformer`, and `graphable` True when the forward reads nothing but its
    arguments' device memory (layers/graph_capture.py)."""

    transformer: torch.nn.Module
    graphs: ShapeGraphs | None = None

    def denoisers(self) -> list[torch.nn.Module]:
        return [self.transformer]

    def use_cuda_graphs(self, max_graphs: int = 8) -> None:
        """Replay the transformer's forward from CUDA graphs, one per (batch, latent, caption)
        shape seen twice (layers/graph_capture.py ShapeGraphs); step-cached forwards, whose
        blocks run or not per request, stay eager. A stage's `diffusion: {cuda_graphs: ...}`."""
        if not self.graphable:
            super().use_cuda_graphs(max_graphs)             # refused
        self.graphs = ShapeGraphs(self.transformer, max_graphs)

    def run_transformer(self, *args: object, step_cache: object = None, **kwargs: object
                        ) -> Tensor:
        """The transformer's forward: from a CUDA graph when they are on and no step cache
        is asked for."""
        if self.graphs is not None and step_cache is None and not lora.applying():
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

    supports_offload = True
    transformer_cls: type
    vae_cls: type
    prompt_encoder_cls: type
    max_size: int = 2048
    packed: bool = True
    default_size: int | None = None
    splits_text = True

    def __init__(self, transformer: torch.nn.Module, vae: torch.nn.Module,
                 prompt_encoder: PromptEncoder | None, scheduler: solver.FlowMatchEulerConfig,
                 device: torch.device) -> None:
        """prompt_encoder None: the conditioning comes from an upstream text-encoder stage."""
        self.transformer = offload.place(transformer, device).eval()
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
                        dtype: torch.dtype | None, text_encoders: bool = True,
                        offload: int = 0):
        """A diffusers folder: transformer/, vae/, the text encoders, scheduler/, in `dtype`
        (None: the transformer's). text_encoders False: none is loaded (a split graph's
        diffusion stage). offload N: the transformer loads into host memory and its blocks
        stay there, streamed to the device N blocks ahead (diffusion/offload.py)."""
        path = _pipeline_folder(path)
        transformer = cls.transformer_cls.from_pretrained(
            path / "transformer", torch.device("cpu") if offload else device, dtype)
        if offload:
            offload_blocks(transformer, device, offload)
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


def _pipeline_folder(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(f"{path}: no model_index.json (not a diffusers pipeline)")
    return path
