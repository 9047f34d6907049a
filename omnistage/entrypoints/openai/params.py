"""OpenAI request fields -> the engine's per-stage parameters.

The parameters a stage gets are built in three layers, later ones winning:

    the stage's YAML `sampling` defaults  <  the OpenAI fields (entry stages only)
                                          <  `sampling_params_list[i]` (the extension)

The graph's own wiring (`output_hidden_layers` of a stage that feeds another) is always kept,
and a client cannot set it. Every bad value is a 400 naming the field it came from.

`sampling_params_list` takes vLLM-Omni's dicts as they are: `detokenize` (the graph decides
which stages make text) is ignored, a vLLM SamplingParams key omnistage does not have is a 400
naming it, and a dict for a stage that samples nothing (code2wav) is checked and ignored.
Ignored fields are logged once per process (`ignore`), not per request.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

from omnistage.configs.parse import from_dict
from omnistage.configs.schema import GraphConfig, StageConfig
from omnistage.diffusion.params import DiffusionParams
from omnistage.entrypoints.openai.errors import bad_request, from_value_error
from omnistage.entrypoints.openai.protocol import SamplingExtras
from omnistage.sampling_params import SamplingParams

StageParams = SamplingParams | DiffusionParams | None
# SamplingParams fields that belong to the graph, not to a request
_GRAPH_ONLY = {"output_hidden_layers", "extra"}
# vLLM SamplingParams fields omnistage has no counterpart for
_VLLM_ONLY = {"best_of", "use_beam_search", "length_penalty", "early_stopping",
              "prompt_logprobs", "logits_processors", "truncate_prompt_tokens",
              "guided_decoding", "structured_outputs", "output_kind", "bad_words",
              "allowed_token_ids", "spaces_between_special_tokens", "logit_bias",
              "flat_logprobs", "extra_args"}
# ASCII digits only: `\d` and int() also take "９６" or "٩٦", which no client means as a size
_SIZE = re.compile(r"([0-9]{1,5})x([0-9]{1,5})", re.ASCII)
logger = logging.getLogger(__name__)
_warned: set[str] = set()


def ignore(param: str, why: str) -> None:
    """An accepted field that changes nothing here: say so in the log, once per field (a
    client that sends it with every request would otherwise fill the log)."""
    if param not in _warned:
        _warned.add(param)
        logger.warning("%s: accepted and ignored (%s)", param, why)


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


def stage_params(graph: GraphConfig, entry: list[str], entry_fields: dict[str, Any],
                 extension: list[dict[str, Any] | None] | None,
                 image: bytes | None = None, extra_images: tuple[bytes, ...] = (),
                 image_fields: bool = False) -> list[StageParams]:
    """One params object per stage of `graph`, in graph order (what AsyncOmni takes as
    `sampling_params_list`). `entry_fields` are the OpenAI fields for the entry stages;
    `image` the input image of an image-to-image request (diffusion entry stages), and
    `extra_images` the others of a multi-image edit. `image_fields`: the fields describe the
    image or video (the images and videos routes): they go to the diffusion stages only, and
    an AR entry stage (GLM-Image's) gets None: its stage's own defaults."""
    if extension is not None and len(extension) != len(graph.stages):
        names = ", ".join(graph.stage_names)
        raise bad_request(f"sampling_params_list has {len(extension)} entries; this model has "
                          f"{len(graph.stages)} stage(s) ({names}): give one dict or null each",
                          "sampling_params_list")
    out: list[StageParams] = []
    for i, stage in enumerate(graph.stages):
        given = (extension or [None] * len(graph.stages))[i]
        path = f"sampling_params_list[{i}]"
        if given is not None and not isinstance(given, dict):
            raise bad_request(f"{path}: expected an object or null", path)
        own = dict(entry_fields) if stage.name in entry and not image_fields else {}
        if stage.kind == "ar":
            out.append(None if image_fields and not given       # None: the stage's defaults
                       else _sampling(stage, own, given or {}, path))
        elif stage.kind == "diffusion":
            # every diffusion stage of a split graph (text encoder -> transformer) needs the
            # request's image fields: the text encoder for CFG, the transformer for the rest
            out.append(_diffusion(dict(entry_fields), given or {}, path, image, extra_images))
        else:
            if given:   # vLLM-Omni sends a sampling dict for code2wav too: checked, unused
                _sampling(stage, {}, given, path)
                ignore(path, f"stage {stage.name!r} ({stage.kind}) samples nothing")
            out.append(None)
    return out


def _vllm_keys(given: dict[str, Any], path: str) -> dict[str, Any]:
    """A per-stage dict as vLLM-Omni writes it, minus `detokenize` (the graph's choice)."""
    unsupported = sorted(_VLLM_ONLY & set(given))
    if unsupported:
        where = f"{path}.{unsupported[0]}"
        raise bad_request(f"{where}: vLLM's SamplingParams.{unsupported[0]} is not supported by "
                          "this server", where)
    if "detokenize" in given:
        ignore("sampling_params_list[].detokenize", "the stage graph decides which stages "
               "detokenize")
        given = {k: v for k, v in given.items() if k != "detokenize"}
    return given


def _sampling(stage: StageConfig, openai: dict[str, Any], given: dict[str, Any],
              path: str) -> SamplingParams:
    given = _vllm_keys(given, path)
    blocked = _GRAPH_ONLY & set(given)
    if blocked:
        raise bad_request(f"{path}.{sorted(blocked)[0]}: set by the stage graph, not by requests",
                          f"{path}.{sorted(blocked)[0]}")
    try:
        params = from_dict(SamplingParams, {**stage.sampling, **openai}, "")
        if given:
            params = from_dict(SamplingParams, {**stage.sampling, **openai, **given}, path)
    except ValueError as exc:
        raise from_value_error(exc) from None
    if stage.output_hidden_layers:
        params = dataclasses.replace(params, output_hidden_layers=stage.output_hidden_layers)
    return params


def _diffusion(openai: dict[str, Any], given: dict[str, Any], path: str,
               image: bytes | None, extra_images: tuple[bytes, ...]) -> DiffusionParams:
    # the input images (bytes) and their strength go in last: strength needs an image
    for name in ("image", "extra_images"):
        if name in given:
            raise bad_request(f"{path}.{name}: send images as image parts (chat) or files "
                              "(/v1/images/edits)", f"{path}.{name}")
    strength = given.get("strength", openai.get("strength"))
    where = f"{path}.strength" if "strength" in given else "strength"
    openai = {k: v for k, v in openai.items() if k != "strength"}
    given = {k: v for k, v in given.items() if k != "strength"}
    try:
        params = from_dict(DiffusionParams, openai, "")
        if given:
            params = from_dict(DiffusionParams, {**openai, **given}, path)
    except ValueError as exc:
        raise from_value_error(exc) from None
    if image is not None or strength is not None:
        if strength is not None and (isinstance(strength, bool)
                                     or not isinstance(strength, (int, float))):
            raise bad_request(f"{where}: expected a number", where)
        try:
            params = dataclasses.replace(params, image=image, extra_images=extra_images,
                                         strength=strength)
        except ValueError as exc:   # the request's field: strength where it was given
            err = from_value_error(exc)
            err.param = where if err.param == "strength" else "image"
            raise err from None
    return params
