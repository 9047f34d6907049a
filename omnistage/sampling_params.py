"""Per-request sampling parameters of an autoregressive stage, checked at the boundary."""

from __future__ import annotations

from dataclasses import dataclass, field

from omnistage.errors import InputError


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
        """Raise InputError (a ValueError) naming the first bad field."""
        def bad(name: str, why: str) -> None:
            raise InputError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}", name)

        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1 (completions per prompt)")
        if not self.temperature >= 0.0:
            bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if self.top_k < 0 and self.top_k != -1:
            bad("top_k", "must be >= 0 (0 or -1 disables top-k)")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", "must be > 0 (1 disables it)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and self.max_tokens <= 0:
            bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0:
            bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", "must be in [0, 20]")
        if any(not s for s in self.stop):
            bad("stop", "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "token ids must be >= 0")
        if any(i < 0 for i in self.output_hidden_layers):
            bad("output_hidden_layers", "layer indices must be >= 0")
