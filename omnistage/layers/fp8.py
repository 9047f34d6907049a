"""FP8 linear layers for diffusion transformers (issue 23): e4m3 weights with one scale per
output channel, quantized once after the bf16 / fp32 checkpoint has loaded, and e4m3
activations with one scale per token, computed on every call. One `torch._scaled_mm` per
layer (rowwise scaling, bf16 out):

    x (M, K) bf16 -> per-token amax -> xq (M, K) e4m3, sx (M, 1) fp32
    W (N, K)      -> per-row amax   -> Wq (N, K) e4m3, sw (1, N) fp32   (once, at load)
    y = _scaled_mm(xq, Wq.t(), sx, sw) = (xq * sx) @ (Wq * sw^T)^T  (+ b, in bf16)

`Wq.t()` is the column-major (K, N) view `_scaled_mm` requires of its second operand; K and N
must be multiples of 16. The bf16 weight is dropped as each layer is swapped, so the swapped
layers' weights take half their bf16 bytes (the scales add 4 bytes per output channel).

Which layers: `quantize_fp8(model)` swaps every linear of the model (nn.Linear, layers/linear.py's
Linear and its merged forms, the tensor-parallel column / row / qkv layers, which hold this rank's
shard: the shard is what is quantized) except

  - those the model keeps, by name (`fp8_keep` on the model class, fnmatch patterns over module
    names). Every native DiT keeps the same kinds: input embeddings of latents, text and
    timestep (few FLOPs, and their errors reach every block), the modulation projections
    (adaLN: their shift / scale / gate multiply every block's activations, so a relative error
    there is multiplied rather than added; they run on one row per image, so FP8 saves nothing),
    and the final norm's modulation and output projection (its error lands on the predicted
    velocity unfiltered). Norms and embeddings tables are no linears and are never touched.
  - small ones: K or N below `min_features` (1024 by default: at smaller sizes quantizing the
    activations costs about what the FP8 matmul saves), or not a multiple of 16.

It needs FP8 tensor cores: a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper); on
anything else `quantize_fp8` raises, except the CPU with `allow_cpu` (tests: torch's CPU build
has a `_scaled_mm` for e4m3 with the same semantics).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable

import torch
from torch import Tensor, nn

from omnistage.layers import fused
from omnistage.layers.linear import Linear
from omnistage.layers.parallel import (ColumnParallelLinear, QKVParallelLinear,
                                       RowParallelLinear, TPGroup, all_gather_last, all_reduce)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max                  # 448
MIN_FEATURES = 1024
MIN_CAPABILITY = (8, 9)
LINEARS = (nn.Linear, Linear, ColumnParallelLinear, RowParallelLinear, QKVParallelLinear)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (M, K) -> (q (M, K) e4m3, scale (M, 1) float32) with x ~= q * scale row by row: each
    row's largest magnitude maps to the largest e4m3 value."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@torch.library.custom_op("omnistage::quantize_rows_fp8", mutates_args=())
def _quantize_rows_kernel(x: Tensor) -> tuple[Tensor, Tensor]:
    return fused.ops_for(x).quantize_rows_fp8(x, FP8, FP8_MAX)


@_quantize_rows_kernel.register_fake
def _(x: Tensor) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=FP8), x.new_empty((x.shape[0], 1), dtype=torch.float32)


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """quantize_rows for a layer's input (M, K): one Triton pass on CUDA (triton_ops.py), an
    opaque op to torch.compile (inductor's own fusion of the PyTorch form took 2.4x its
    time on an H100); else the PyTorch form."""
    return _quantize_rows_kernel(x) if fused.ops_for(x) is not None else quantize_rows(x)


def dequantize_rows(q: Tensor, scale: Tensor) -> Tensor:
    """The float32 values `quantize_rows` stands for: q * scale, scale (M, 1)."""
    return q.float() * scale


def fp8_matmul(xq: Tensor, sx: Tensor, wq: Tensor, sw: Tensor, bias: Tensor | None = None
               ) -> Tensor:
    """(xq * sx) @ (wq * sw^T)^T [+ bias] in bf16: xq (M, K), sx (M, 1), wq (N, K), sw (1, N),
    bias (N,) bf16, added in the matmul's epilogue (not a pass of its own over the output)."""
    return torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, bias=bias,
                            out_dtype=torch.bfloat16)


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W in e4m3 (per output channel scales) and x quantized per token.
    Keeps the tensor-parallel duties of the layer it replaces: a row-parallel one adds the
    bias on rank 0 only and all-reduces (`reduce_results`), a column-parallel one with
    `gather_output` gathers the ranks' outputs."""

    def __init__(self, weight: Tensor, bias: Tensor | None, tp: TPGroup,
                 gather_output: bool = False, reduce_results: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape                 # this rank's shard
        self.tp, self.gather_output, self.reduce_results = tp, gather_output, reduce_results
        wq, scale = quantize_rows(weight.detach())
        self.register_buffer("weight", wq)                                 # (N, K) e4m3
        self.register_buffer("weight_scale", scale.t().contiguous())      # (1, N) float32
        self.register_buffer("bias", None if bias is None
                             else bias.detach().to(torch.bfloat16, copy=True))  # the epilogue's

    @classmethod
    def from_linear(cls, linear: nn.Module) -> Fp8Linear:
        """The FP8 form of one of `LINEARS` (its local shard, with its bias as it adds it)."""
        weight, bias, tp, kw = shard_of(linear)
        return cls(weight, bias, tp, **kw)

    def forward(self, x: Tensor) -> Tensor:
        xq, sx = quantize_activations(x.reshape(-1, self.in_features))     # (M, K), (M, 1)
        sw = self.weight_scale.view(1, -1)                                 # (1, N); a
        y = fp8_matmul(xq, sx, self.weight, sw, self.bias)  # checkpoint's is (N, 1). (M, N) bf16
        return self.finish(y.to(x.dtype).unflatten(0, x.shape[:-1]))

    def finish(self, y: Tensor) -> Tensor:
        """This rank's product (bias included) combined as the replaced layer did: summed
        over the ranks of a row-parallel layer, gathered for a column-parallel one that
        gathers (fused.py calls it after its matrix-vector kernel)."""
        if self.reduce_results:
            y = all_reduce(y, self.tp)
        return all_gather_last(y, self.tp) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def shard_of(linear: nn.Module) -> tuple[Tensor, Tensor | None, TPGroup, dict]:
    """One of `LINEARS` as a quantized linear takes it: its local weight, the bias as it adds
    it, its TP group and how its output is combined (reduce_results / gather_output)."""
    if isinstance(linear, RowParallelLinear):
        return linear.weight, linear.local_bias, linear.tp, \
            {"reduce_results": linear.reduce_results}
    if isinstance(linear, ColumnParallelLinear):
        return linear.weight, linear.bias, linear.tp, {"gather_output": linear.gather_output}
    tp = linear.tp if isinstance(linear, QKVParallelLinear) else TPGroup(0, 1, None)
    return linear.weight, linear.bias, tp, {}


def check_fp8_device(device: torch.device, allow_cpu: bool = False) -> None:
    """ValueError unless `device` has FP8 matmuls: CUDA capability >= 8.9, or the CPU when
    `allow_cpu` (tests)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < MIN_CAPABILITY:
            raise ValueError(
                f"quantization fp8 needs a GPU with FP8 tensor cores (compute capability 8.9 "
                f"or newer: Ada, Hopper); {torch.cuda.get_device_name(device)} has "
                f"{major}.{minor}: run this stage without quantization")
    elif not (device.type == "cpu" and allow_cpu):
        raise ValueError(f"quantization fp8 runs on CUDA GPUs of compute capability 8.9 or "
                         f"newer; this model is on {device}: run it without quantization")


def is_kept(name: str, linear: nn.Module, keep: tuple[str, ...], min_features: int) -> bool:
    """Whether the linear `name` stays as it is: named by the model's policy, smaller than
    `min_features` on either side, or with a side `_scaled_mm` cannot take (not a multiple
    of 16)."""
    n, k = linear.weight.shape
    return (any(fnmatch.fnmatchcase(name, pattern) for pattern in keep)
            or min(n, k) < min_features or n % 16 != 0 or k % 16 != 0)


def quantize_fp8(model: nn.Module, min_features: int = MIN_FEATURES,
                 allow_cpu: bool = False, keep: tuple[str, ...] | None = None) -> list[str]:
    """Swap the model's eligible linears for Fp8Linear in place (the module docstring says
    which); returns the names swapped. The model says what it keeps in `fp8_keep` (or the
    caller in `keep`: an AR stage's policy); a model with neither has no FP8 policy and is
    refused."""
    keep = getattr(model, "fp8_keep", None) if keep is None else keep
    if keep is None:
        raise ValueError(f"{type(model).__name__} has no FP8 policy (fp8_keep): it runs "
                         "without quantization")
    check_fp8_device(next(model.parameters()).device, allow_cpu)
    return swap_linears(model, Fp8Linear.from_linear, keep, min_features)


def swap_linears(model: nn.Module, make: Callable[[nn.Module], nn.Module],
                 keep: tuple[str, ...], min_features: int) -> list[str]:
    """Replace every one of `LINEARS` in `model` that `is_kept` does not keep by `make(it)`,
    in place; returns the names replaced (the old layers, and their weights, dropped)."""
    swapped = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, LINEARS) or is_kept(name, module, keep, min_features):
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, make(module))
        swapped.append(name)
    return swapped
