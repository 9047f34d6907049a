"""A chat request's checks that need no model and fetch nothing: the OpenAI fields this
server accepts and ignores (logged), those it cannot honour (400), and the fields that mean
nothing to an image or video model."""

from __future__ import annotations

from omnistage.entrypoints.openai.errors import bad_request
from omnistage.entrypoints.openai.params import ignore
from omnistage.entrypoints.openai.protocol import ChatCompletionRequest

# OpenAI sampling fields that mean nothing to an image or video model
_TEXT_ONLY = ("temperature", "top_p", "stop", "presence_penalty", "frequency_penalty", "top_k",
              "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
              "max_tokens", "max_completion_tokens", "logprobs")
# OpenAI fields accepted with no effect here, and why
_IGNORED = {"verbosity": "the model decides its own length",
            "service_tier": "one tier here", "safety_identifier": "no abuse monitoring here",
            "prompt_cache_key": "prefix caching needs no key",
            "prompt_cache_retention": "prefix caching keeps what memory allows",
            "store": "this server stores no completions",
            "metadata": "this server stores no completions",
            "user": "no abuse monitoring here"}
# OpenAI fields this server cannot honour: a 400 when set (to other than the "off" value)
_UNSUPPORTED = {"tools": ("tool calling", []), "tool_choice": ("tool calling", "none"),
                "functions": ("function calling", []), "function_call": ("function calling",
                                                                         "none"),
                "prediction": ("predicted outputs", None),
                "web_search_options": ("web search", None)}


def check_unsupported(req: ChatCompletionRequest) -> None:
    for name, (what, off) in _UNSUPPORTED.items():
        if getattr(req, name) not in (None, off):
            raise bad_request(f"{name}: {what} is not supported by this server", name)
    if req.response_format and req.response_format.get("type") != "text":
        raise bad_request("response_format: only {\"type\": \"text\"} is supported",
                          "response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs: needs logprobs: true", "top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options: only allowed with stream: true", "stream_options")
    for name, why in _IGNORED.items():
        if getattr(req, name):         # store: false, metadata: {} ask for nothing
            ignore(name, why)
    for key, value in (req.mm_processor_kwargs or {}).items():
        if key != "use_audio_in_video":
            raise bad_request(f"mm_processor_kwargs.{key}: not a processor option here "
                              "(known: use_audio_in_video)", f"mm_processor_kwargs.{key}")
        if not isinstance(value, bool):
            raise bad_request("mm_processor_kwargs.use_audio_in_video: true or false",
                              "mm_processor_kwargs.use_audio_in_video")


def check_diffusion(req: ChatCompletionRequest, what: str) -> None:
    """An image or video model's request (`what`: "image" or "video"): no text sampling
    fields, one choice."""
    for name in _TEXT_ONLY:
        if getattr(req, name) not in (None, False):
            raise bad_request(f"{name}: does not apply to an {what} model (set {what} "
                              "parameters in sampling_params_list)", name)
    if req.n != 1:
        more = ("sampling_params_list [{\"num_images\": N}]" if what == "image"
                else "one request per video")
        raise bad_request(f"n={req.n}: one choice per request; ask for more with {more}", "n")
