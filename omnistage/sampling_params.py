"""Per-request sampling parameters of an autoregressive stage, checked at the boundary."""

from __future__ import annotations

from dataclasses import dataclass, field

from omnistage.errors import InputError
from omnistage.ranges import MAX_INT32, MAX_SEED, Range, check_ranges, numeric_fields

MAX_STOP = 16                   # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 1024           # per stop string
MAX_STOP_TOKEN_IDS = 256


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples its tokens. Mirrors vLLM's fields and defaults where they exist.

    `n` asks for n completions of the prompt (`RequestOutput.outputs[i]`); the engine runs them
    as n requests, completion i with `seed + i` when a seed is set (so completion 0 is what
    n=1 gives). temperature == 0 means greedy. top_k <= 0 means no top-k. max_tokens None means "until the
    model's maximum length". Penalties follow vLLM: repetition_penalty (HF rule, prompt and output
    tokens), presence/frequency penalties (OpenAI rule, output tokens only).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 256
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (0: only the sampled one)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    # Hidden states a downstream stage needs: HF `output_hidden_states` indices (0 = embeddings,
    # i = output of decoder layer i, num_layers = after the final norm), for every computed token.
    output_hidden_layers: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Normalise list inputs so that a params object is hashable and comparable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids", "output_hidden_layers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise InputError (a ValueError) naming the first bad field. Every limit the OpenAI
        routes set on a field is here, so a per-stage override meets it too."""
        check_ranges("SamplingParams", self, _RANGES)

        def bad(name: str, why: str) -> None:
            shown = repr(getattr(self, name))    # a list of 10,000 stop strings: its start
            shown = shown if len(shown) <= 80 else f"{shown[:77]}..."
            raise InputError(f"SamplingParams.{name}={shown}: {why}", name)

        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if len(self.stop) > MAX_STOP or any(not isinstance(s, str) for s in self.stop):
            bad("stop", f"at most {MAX_STOP} strings")
        if any(not 0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            bad("stop", f"stop strings must be non-empty, at most {MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids")


# every numeric field: kind, finiteness and range (ranges.py)
_RANGES = {
    "n": Range(1, 128, integer=True),
    "temperature": Range(0.0, 2.0),                 # 0 means greedy
    "top_p": Range(0.0, 1.0, lo_open=True),
    "top_k": Range(-1, MAX_INT32, integer=True),    # 0 or -1 disables top-k
    "min_p": Range(0.0, 1.0),
    "repetition_penalty": Range(0.0, 10.0, lo_open=True),   # 1 disables it
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "seed": Range(0, MAX_SEED, integer=True),
    "max_tokens": Range(1, MAX_INT32, integer=True),
    "min_tokens": Range(0, MAX_INT32, integer=True),
    "stop_token_ids": Range(0, MAX_INT32, integer=True),
    "logprobs": Range(0, 20, integer=True),          # OpenAI's top_logprobs limit
    "output_hidden_layers": Range(0, 4096, integer=True),
}
assert numeric_fields(SamplingParams) == set(_RANGES), \
    f"a numeric field without a range: {numeric_fields(SamplingParams) ^ set(_RANGES)}"
