"""A stage's quantization, per component (issue 44): which of its networks run quantized, and
how. One record, read the same way from the graph YAML, the `--quantization` flag and Python:

    diffusion:
      quantization: fp8                                  # the transformer, FP8
      quantization: {transformer: int8, text_encoder: int8}
      quantization: {transformer: "gguf:/models/flux1-dev-Q4_K_S.gguf"}
      quantization: {transformer: {method: gguf, file: /models/flux1-dev-Q4_K_S.gguf}}
      quantization: {transformer: fp8, attention: fp8}   # and the DiT's attention in FP8

    omnistage serve black-forest-labs/FLUX.1-dev --quantization fp8
    omnistage serve ... --quantization transformer=gguf:/models/flux1-dev-Q4_K_S.gguf,text_encoder=int8
    omnistage serve Qwen/Qwen-Image --quantization transformer=fp8,attention=fp8
    Omni(model=..., quantization={"transformer": "int8"})

    ar:                                                  # an AR stage: its one model
      quantization: int8                                 # a text LLM (the bare method)
      quantization: int4                                 # W4A16, groups of 128
      quantization: {thinker: fp8}                       # Qwen3-Omni's thinker stage

A bare method names the transformer. Methods: `fp8` (layers/fp8.py: e4m3 W8A8, CUDA 8.9+),
`int8` (layers/int8.py: W8A8 through torch._int_mm, CPU and CUDA), `gguf:FILE` (the weights of
a GGUF file, models/gguf_loader.py; the transformer only), `int4` (layers/int4.py: W4A16,
symmetric groups of 128 inputs; an AR model only), `none`. Components: transformer,
text_encoder, vae, attention, thinker, talker; which a stage can apply is the stage's to say (a
diffusion stage: transformer, text_encoder and attention, `check_diffusion`; an AR stage: its
one model, `ar_method`; the others are refused there by name). `attention: fp8` is the
denoiser's attention with Q and K in e4m3 (layers/fp8_attention.py, CUDA 8.9+; on CPU its
float32 emulation); it takes fp8 only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Literal

from omnistage.configs.strict import from_dict

Method = Literal["none", "fp8", "int8", "int4", "gguf"]
METHODS: tuple[str, ...] = ("none", "fp8", "int8", "int4", "gguf")
COMPONENTS: tuple[str, ...] = ("transformer", "text_encoder", "vae", "attention", "thinker",
                               "talker")


@dataclass(frozen=True, slots=True)
class ComponentQuantization:
    """One network's method, and the file a `gguf` one reads."""

    method: Method = field(default="none", metadata={"help": "none, fp8, int8, int4 or gguf"})
    file: str | None = field(default=None, metadata={"help": "the .gguf file of method gguf"})

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method: {self.method!r} is not one of {', '.join(METHODS)}")
        if self.method == "gguf" and not self.file:
            raise ValueError("file: the gguf method needs the .gguf file (gguf:PATH)")
        if self.method != "gguf" and self.file is not None:
            raise ValueError(f"file: only the gguf method reads a file, not {self.method}")

    @classmethod
    def parse(cls, text: str) -> ComponentQuantization:
        """`fp8`, `int8`, `int4`, `none` or `gguf:PATH`."""
        method, sep, file = text.strip().partition(":")
        if method not in METHODS:
            raise ValueError(f"{text!r} is not one of fp8, int8, int4, none, gguf:FILE")
        return cls(method, file if sep else None)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"gguf:{self.file}" if self.method == "gguf" else self.method


@dataclass(frozen=True, slots=True)
class Quantization:
    """Each component's method; a string stands for `ComponentQuantization.parse` of it."""

    transformer: ComponentQuantization | str | None = field(default=None, metadata={
        "help": "the denoiser(s): fp8, int8 or gguf:FILE (a bare method names it; an AR "
                "stage's text LLM: fp8, int8 or int4)"})
    text_encoder: ComponentQuantization | str | None = field(default=None, metadata={
        "help": "the prompt encoder's networks: int8"})
    vae: ComponentQuantization | str | None = field(default=None, metadata={
        "help": "the VAE: none only (its convolutions are no linears)"})
    attention: ComponentQuantization | str | None = field(default=None, metadata={
        "help": "the denoiser's attention: fp8 (Q and K in e4m3, CUDA 8.9+; a diffusion "
                "stage only)"})
    thinker: ComponentQuantization | str | None = field(default=None, metadata={
        "help": "an omni model's thinker (its AR stage): fp8, int8 or int4"})
    talker: ComponentQuantization | str | None = field(default=None, metadata={
        "help": "an omni model's talker (its AR stage): fp8, int8 or int4"})

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, str):
                try:
                    value = ComponentQuantization.parse(value)
                except ValueError as e:
                    raise ValueError(f"{f.name}: {e}") from None
            if value is not None and value.method == "none":
                value = None
            if value is not None and f.name == "attention" and value.method != "fp8":
                raise ValueError(f"attention: {value} is not an attention method (supported: "
                                 "fp8, none)")
            if value is not None and f.name in DIFFUSION_METHODS and f.name != "transformer":
                check_diffusion_component(f.name, value)   # never an AR model's
            object.__setattr__(self, f.name, value)

    @classmethod
    def parse(cls, text: str) -> Quantization:
        """The flag's form: `fp8` (the transformer) or `COMPONENT=METHOD[,COMPONENT=METHOD]`."""
        if "=" not in text:
            return cls(transformer=text)
        items = {}
        for item in text.split(","):
            name, sep, method = item.partition("=")
            name = name.strip()
            if not sep or name not in COMPONENTS:
                raise ValueError(f"{item!r}: expected COMPONENT=METHOD with COMPONENT one of "
                                 f"{', '.join(COMPONENTS)}")
            items[name] = method
        return cls(**items)

    def items(self) -> dict[str, ComponentQuantization]:
        """The components that run quantized, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.items().items()) or "none"


def read_quantization(value: Quantization | str | None) -> Quantization | None:
    """A field's value as the record (a string parsed), None when nothing is quantized."""
    if isinstance(value, str):
        value = Quantization.parse(value)
    elif isinstance(value, Mapping):          # Python's dict form (YAML's is built by strict.py)
        value = from_dict(Quantization, dict(value))
    return value if value is not None and value.items() else None


AR_METHODS: tuple[str, ...] = ("fp8", "int8", "int4")
# component -> the methods a diffusion stage applies to it (stages/quantize.py applies them)
DIFFUSION_METHODS: dict[str, tuple[str, ...]] = {
    "transformer": ("fp8", "int8", "gguf"), "text_encoder": ("int8",), "vae": ("none",),
    "attention": ("fp8",)}
AR_ONLY: tuple[str, ...] = ("int4",)


def check_diffusion_component(name: str, c: ComponentQuantization) -> None:
    """ValueError naming the component for a method only an AR model takes (int4)."""
    if c.method in AR_ONLY:
        raise ValueError(f"{name}: {c.method} quantizes an AR model (thinker, talker, a text "
                         f"LLM's bare method), not a diffusion stage's {name} (it takes "
                         f"{', '.join(DIFFUSION_METHODS[name])})")


def check_diffusion(q: Quantization | None) -> Quantization | None:
    """`q` as a diffusion stage's record: ValueError naming the component for an AR-only
    method (int4 on the transformer, the text encoder or the VAE); the other methods a
    component cannot take are refused when the stage starts (stages/quantize.py)."""
    for name, c in (q.items() if q is not None else {}).items():
        if name in DIFFUSION_METHODS:
            check_diffusion_component(name, c)
    return q


def ar_role(component: str | None) -> str:
    """The record's name for the one model an AR stage loads: `thinker` / `talker` for a
    component that is one (qwen3_omni_thinker, qwen3_tts_talker), else `transformer` (a text
    LLM, and what a bare method names)."""
    for role in ("thinker", "talker"):
        if component is not None and (component == role or component.endswith("_" + role)):
            return role
    return "transformer"


def ar_method(q: Quantization | None, component: str | None) -> ComponentQuantization | None:
    """The method an AR stage applies to its model: the record's entry for its role
    (`ar_role`), or the bare method (`transformer`) on a thinker / talker stage. ValueError
    naming the entry for what an AR stage cannot apply (another component, gguf, both a bare
    method and the role's own)."""
    if q is None:
        return None
    role = ar_role(component)
    items = q.items()
    for name, c in items.items():
        if name == "attention":
            raise ValueError(f"attention: {c} attention serves a diffusion stage's denoiser; "
                             "an AR stage's paged attention is not quantized")
        if name not in (role, "transformer"):
            raise ValueError(f"{name}: this AR stage loads the {role} "
                             f"({component or 'the checkpoint'}); quantize its {name} on the "
                             f"stage that loads it")
        if c.method not in AR_METHODS:
            raise ValueError(f"{name}: {c} is not applied to an AR model "
                             f"(supported: {', '.join(AR_METHODS)})")
    if role != "transformer" and len(items) > 1:
        raise ValueError(f"transformer and {role} both name this stage's model: give one")
    return next(iter(items.values()), None)
