"""The front door's request record: what a caller asks of the engine, built by one function
(`build_request`) for the OpenAI server, `Omni` and `AsyncOmni` alike.

    caller                  build_request(graph, entry, prompt, params | fields)   -> OmniRequest
    AsyncOmni.prepare       prompt parsed and checked, params checked               -> Prepared
    AsyncOmni.add_request   admitted into the orchestrator, events to a sink        -> OmniOutput

The per-stage params come in one of two forms:

- `params`: what the Python API takes as `sampling_params_list`: one SamplingParams (the entry
  stages'), one DiffusionParams (every diffusion stage's), or one entry per stage (None: that
  stage's defaults);
- `fields` (`RequestFields`): the OpenAI server's, built in three layers, later ones winning:

      the stage's YAML `sampling` defaults  <  the request's fields (entry stages only)
                                            <  `sampling_params_list[i]` (the extension)

  The graph's own wiring (`output_hidden_layers` of a stage that feeds another) is always
  kept, and a client cannot set it. `sampling_params_list` takes vLLM-Omni's dicts as they
  are: `detokenize` is ignored (the graph decides), a vLLM key omnistage lacks is refused, and
  a dict for a stage that samples nothing (code2wav) is checked and ignored.

Every refusal is an InputError naming the field it came from (the server answers 400 with it).
A field accepted with no effect goes through `ignore`: logged once per field, and named to the
caller collecting them (`collect_ignored`: the server's `X-Omnistage-Ignored` header).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from omnistage.configs.graph import stages_needed
from omnistage.configs.schema import GraphConfig, StageConfig
from omnistage.configs.strict import from_dict
from omnistage.diffusion_params import DiffusionParams
from omnistage.errors import InputError
from omnistage.sampling_params import SamplingParams

StageParams = SamplingParams | DiffusionParams | None
ParamsList = SamplingParams | DiffusionParams | list[StageParams] | None
PromptType = str | dict[str, Any]
# SamplingParams fields that belong to the graph, not to a request
_GRAPH_ONLY = {"output_hidden_layers", "extra"}
# vLLM SamplingParams fields omnistage has no counterpart for
_VLLM_ONLY = {"best_of", "use_beam_search", "length_penalty", "early_stopping",
              "prompt_logprobs", "logits_processors", "truncate_prompt_tokens",
              "guided_decoding", "structured_outputs", "output_kind", "bad_words",
              "allowed_token_ids", "spaces_between_special_tokens", "logit_bias",
              "flat_logprobs", "extra_args"}
logger = logging.getLogger(__name__)
_warned: set[str] = set()
# the names `ignore` was called with while a caller collects them (None: nobody does)
_ignored: ContextVar[list[str] | None] = ContextVar("ignored_fields", default=None)


@dataclass(frozen=True, slots=True)
class RequestFields:
    """The server's form of a request's params (see the module docstring). `images`: the
    input image files of an image-to-image request or an edit (diffusion stages), in order.
    `image_fields`: the fields describe the image or video (the images and videos routes):
    they go to the diffusion stages only, and an AR entry stage (GLM-Image's) keeps its own
    defaults. `voice`: `extra["speaker"]` on every AR stage (Qwen3-Omni's talker reads it);
    `entry_extra`: more of `extra` on the entry stages (a TTS model's voice or clip)."""

    entry: dict[str, Any] = field(default_factory=dict)
    extension: list[dict[str, Any] | None] | None = None
    images: tuple[bytes, ...] = ()
    image_fields: bool = False
    voice: str | None = None
    entry_extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class OmniRequest:
    """One request at the front door. `params`: one per stage, in graph order. `modalities`:
    the finals asked for (None: every final the graph makes). `want_progress`: per-step
    progress events (diffusion steps) reach this caller; without it the orchestrator sends
    none. `param` names the request field a prompt refusal points at, and `max_tokens`
    (field, new tokens asked) makes the prompt and that many tokens fit the context (both
    for the server's 400s)."""

    prompt: PromptType
    params: tuple[StageParams, ...]
    modalities: frozenset[str] | None = None
    request_id: str | None = None
    prefix: str = "req"
    want_progress: bool = False
    param: str | None = None
    max_tokens: tuple[str, int] | None = None

    def by_stage(self, graph: GraphConfig) -> dict[str, StageParams]:
        return dict(zip(graph.stage_names, self.params))


def build_request(graph: GraphConfig, entry: list[str], prompt: PromptType,
                  params: ParamsList | RequestFields = None, *,
                  modalities: set[str] | frozenset[str] | None = None,
                  want_progress: bool = False, request_id: str | None = None,
                  prefix: str = "req", param: str | None = None,
                  max_tokens: tuple[str, int] | None = None) -> OmniRequest:
    """The one way a request record is made; InputError naming the field for bad params."""
    if isinstance(params, RequestFields):
        # the stages the modalities asked for take the fields (BAGEL: a text answer's
        # sampling fields are not its image stage's); the others their defaults
        finals = {s.final for s in graph.stages if s.final} & set(modalities or ())
        per_stage = stage_params(graph, entry, params,
                                 stages_needed(graph, finals) if finals else None)
    else:
        per_stage = _given_params(graph, entry, params)
    return OmniRequest(prompt, tuple(per_stage),
                       None if modalities is None else frozenset(modalities), request_id,
                       prefix, want_progress, param, max_tokens)


def ignore(param: str, why: str) -> None:
    """An accepted field that changes nothing here: say so in the log, once per field (a
    client that sends it with every request would otherwise fill the log), and name it to
    the request's collector if one is open (`collect_ignored`), once per request."""
    names = _ignored.get()
    if names is not None and param not in names:
        names.append(param)
    if param not in _warned:
        _warned.add(param)
        logger.warning("%s: accepted and ignored (%s)", param, why)


@contextlib.contextmanager
def collect_ignored() -> Iterator[list[str]]:
    """The fields `ignore` names while this is open (in this context and the tasks and
    threads that copy it), in order, once each: what the answer tells the client it ignored."""
    names: list[str] = []
    token = _ignored.set(names)
    try:
        yield names
    finally:
        _ignored.reset(token)


# -- the Python API's form -----------------------------------------------------------------------
def _given_params(graph: GraphConfig, entry: list[str], given: ParamsList) -> list[StageParams]:
    kinds = {s.name: s.kind for s in graph.stages}
    wants = {"ar": SamplingParams, "diffusion": DiffusionParams}
    if given is None:
        return [None] * len(kinds)
    if isinstance(given, (SamplingParams, DiffusionParams)):
        # SamplingParams go to the entry stages; DiffusionParams to every diffusion stage
        # (a split graph's text-encoder stage and the denoiser it feeds serve one request)
        pool = entry if isinstance(given, SamplingParams) else list(kinds)
        targets = [n for n in pool if wants.get(kinds[n]) is type(given)]
        if not targets:
            raise ValueError(f"{type(given).__name__} given, but no entry stage takes it "
                             f"(entry stages: {', '.join(entry)})")
        return [given if n in targets else None for n in kinds]
    given = list(given)
    if len(given) != len(kinds):
        raise ValueError(f"sampling_params_list has {len(given)} entries, this model has "
                         f"{len(kinds)} stage{'s' if len(kinds) > 1 else ''} "
                         f"({', '.join(kinds)})")
    for (name, kind), p in zip(kinds.items(), given):
        want = wants.get(kind)
        if p is not None and (want is None or not isinstance(p, want)):
            raise ValueError(f"sampling_params_list entry for stage {name!r} ({kind}) must "
                             f"be {want.__name__ if want else 'None'} or None, got "
                             f"{type(p).__name__}")
    return given


# -- the server's form ---------------------------------------------------------------------------
def stage_params(graph: GraphConfig, entry: list[str], fields: RequestFields,
                 needed: set[str] | None = None) -> list[StageParams]:
    """One params object per stage of `graph`, in graph order, from the server's fields
    (`needed`: the stages the request runs; None for the others)."""
    extension = fields.extension
    if extension is not None and len(extension) != len(graph.stages):
        names = ", ".join(graph.stage_names)
        raise InputError(f"sampling_params_list has {len(extension)} entries; this model has "
                         f"{len(graph.stages)} stage(s) ({names}): give one dict or null each",
                         "sampling_params_list")
    out: list[StageParams] = []
    for i, stage in enumerate(graph.stages):
        given = (extension or [None] * len(graph.stages))[i]
        path = f"sampling_params_list[{i}]"
        if given is not None and not isinstance(given, dict):
            raise InputError(f"{path}: expected an object or null", path)
        if needed is not None and stage.name not in needed:
            out.append(None)
            continue
        is_entry = stage.name in entry
        own = dict(fields.entry) if is_entry and not fields.image_fields else {}
        if stage.kind == "ar":
            p = (None if fields.image_fields and not given       # None: the stage's defaults
                 else _sampling(stage, own, given or {}, path))
            out.append(_with_extra(p, fields, is_entry))
        elif stage.kind == "diffusion":
            # every diffusion stage of a split graph (text encoder -> transformer) needs the
            # request's image fields: the text encoder for CFG, the transformer for the rest
            out.append(_diffusion(dict(fields.entry), given or {}, path, fields.images))
        else:
            if given:   # vLLM-Omni sends a sampling dict for code2wav too: checked, unused
                _sampling(stage, {}, given, path)
                ignore(path, f"stage {stage.name!r} ({stage.kind}) samples nothing")
            out.append(None)
    return out


def _with_extra(p: SamplingParams | None, fields: RequestFields, is_entry: bool
                ) -> SamplingParams | None:
    extra = {**(fields.entry_extra if is_entry else {}),
             **({"speaker": fields.voice} if fields.voice is not None else {})}
    if p is None or not extra:
        return p
    return dataclasses.replace(p, extra={**p.extra, **extra})


def _vllm_keys(given: dict[str, Any], path: str) -> dict[str, Any]:
    """A per-stage dict as vLLM-Omni writes it, minus `detokenize` (the graph's choice)."""
    unsupported = sorted(_VLLM_ONLY & set(given))
    if unsupported:
        where = f"{path}.{unsupported[0]}"
        raise InputError(f"{where}: vLLM's SamplingParams.{unsupported[0]} is not supported by "
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
        raise InputError(f"{path}.{min(blocked)}: set by the stage graph, not by "
                         "requests", f"{path}.{min(blocked)}")
    defaults = stage.ar.sampling if stage.ar is not None else {}
    params = from_dict(SamplingParams, {**defaults, **openai}, "")
    if given:
        params = from_dict(SamplingParams, {**defaults, **openai, **given}, path)
    if stage.ar is not None and stage.ar.output_hidden_layers:
        params = dataclasses.replace(params, output_hidden_layers=stage.ar.output_hidden_layers)
    return params


def _diffusion(openai: dict[str, Any], given: dict[str, Any], path: str,
               images: tuple[bytes, ...]) -> DiffusionParams:
    # the input images (bytes) and their strength go in last: strength needs an image
    for name in ("image", "extra_images"):
        if name in given:
            raise InputError(f"{path}.{name}: send images as image parts (chat) or files "
                             "(/v1/images/edits)", f"{path}.{name}")
    strength = given.get("strength", openai.get("strength"))
    where = f"{path}.strength" if "strength" in given else "strength"
    openai = {k: v for k, v in openai.items() if k != "strength"}
    given = {k: v for k, v in given.items() if k != "strength"}
    params = from_dict(DiffusionParams, openai, "")
    if given:
        params = from_dict(DiffusionParams, {**openai, **given}, path)
    if not images and strength is None:
        return params
    if strength is not None and (isinstance(strength, bool)
                                 or not isinstance(strength, (int, float))):
        raise InputError(f"{where}: expected a number", where)
    first, *others = images or (None,)
    try:
        return dataclasses.replace(params, image=first, extra_images=tuple(others),
                                   strength=strength)
    except ValueError as exc:   # the request's field: strength where it was given
        named = exc.param if isinstance(exc, InputError) else None
        raise InputError(str(exc), where if named == "strength" else "image") from None
