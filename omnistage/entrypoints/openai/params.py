"""OpenAI request fields -> the fields of the front door's request record.

What a stage finally gets (the YAML defaults, these fields, `sampling_params_list`, layered)
is built by the front door, engine/request.py (`build_request`); here only the OpenAI names
are read: the sampling fields of a chat or completion request and an image `size`.
"""

from __future__ import annotations

import re
from typing import Any

from omnistage.engine.request import ignore  # noqa: F401  (re-exported: routes log with it)
from omnistage.entrypoints.openai.errors import bad_request
from omnistage.entrypoints.openai.protocol import SamplingExtras

# ASCII digits only: `\d` and int() also take "９６" or "٩٦", which no client means as a size
_SIZE = re.compile(r"([0-9]{1,5})x([0-9]{1,5})", re.ASCII)


def openai_sampling_fields(req: SamplingExtras, max_tokens: int | None,
                           logprobs: int | None) -> dict[str, Any]:
    """The SamplingParams fields a chat or completion request sets explicitly."""
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias")
    fields: dict[str, Any] = {"n": req.n} if req.n != 1 else {}
    for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                 "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                 "skip_special_tokens", "include_stop_str_in_output"):
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    if req.stop is not None:
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if any(not s for s in stops):
            raise bad_request("stop: stop strings must be non-empty", "stop")
        fields["stop"] = stops
    if req.stop_token_ids is not None:
        fields["stop_token_ids"] = list(req.stop_token_ids)
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    if logprobs is not None:
        fields["logprobs"] = logprobs
    if (fields.get("min_tokens") or 0) > (fields.get("max_tokens") or float("inf")):
        raise bad_request(f"min_tokens={fields['min_tokens']}: must be <= max_tokens "
                          f"({fields['max_tokens']})", "min_tokens")
    return fields


def parse_size(size: str | None, param: str = "size") -> tuple[int | None, int | None]:
    """"WxH" -> (height, width); None or "auto" -> the model's default."""
    if size is None or size == "auto":
        return None, None
    m = _SIZE.fullmatch(size.strip())
    if not m or not all(0 < int(v) <= 16384 for v in m.groups()):
        raise bad_request(f"{param}={size!r}: expected WIDTHxHEIGHT in pixels, e.g. 512x512, "
                          "or auto", param)
    width, height = int(m.group(1)), int(m.group(2))
    return height, width
