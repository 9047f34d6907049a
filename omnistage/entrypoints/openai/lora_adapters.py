"""LoRA adapters the server knows by name: loaded at start (`--lora-modules`) or at run time
(vLLM's `POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter`), listed by
`GET /v1/models` (id: the name, parent: the served model, root: the path), and chosen per
request by `"model": "<name>"` (as vLLM) or a `lora` object naming it without a path.

    POST /v1/load_lora_adapter   {"lora_name": "ink", "lora_path": "/loras/ink.safetensors"}
      200 text/plain  Success: LoRA adapter 'ink' added successfully.
      400  already loaded (unless "load_inplace": true), not a LoRA file, no image model
      404  no such file or folder (vLLM's NotFoundError: "... No adapter found for PATH")
    POST /v1/unload_lora_adapter {"lora_name": "ink"}
      200 text/plain  Success: LoRA adapter 'ink' removed successfully.
      404  not loaded

What a request names is resolved here to vLLM-Omni's per-request form, name *and* path
(`resolve`): the stage loads the file on first use and keeps it (diffusion/lora.py), so an
adapter chosen by name gives exactly what the same adapter given by path gives, on every
replica and rank. An unload only forgets the name here: requests already sent carry the path
and finish with it, and the stage frees the tensors when it evicts them (past its 8 held).
A name given another file later (unload, then load) reaches the stage as `name@path`
(`_stage_name`), so the stage never swaps the file under a running request.
The files are checked at load for what needs no model (a safetensors file of LoRA weights in
a layout we read); shapes that do not fit the model are a 400 naming `lora.path` on the first
request that uses the adapter.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from omnistage.configs.lora_modules import LoraModule
from omnistage.diffusion.lora_formats import check_adapter
from omnistage.entrypoints.openai.errors import APIError, bad_request, check_model
from omnistage.entrypoints.openai.protocol import LoraBody, ModelCard, Request

logger = logging.getLogger(__name__)
MAX_KNOWN = 1024        # names learned from per-request paths, least recently used forgotten
Body = TypeVar("Body", bound=Any)
_Name = Annotated[str, Field(min_length=1, max_length=256)]


class LoadLoraAdapterRequest(Request):
    """vLLM's body of POST /v1/load_lora_adapter."""

    lora_name: _Name
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]
    load_inplace: bool = False          # vLLM's: replace an adapter loaded under that name


class UnloadLoraAdapterRequest(Request):
    """vLLM's body of POST /v1/unload_lora_adapter (`lora_int_id`: accepted, unused)."""

    lora_name: _Name
    lora_int_id: int | None = None


class LoraAdapters:
    """The adapters of one server: `loaded` (listed, by the routes or --lora-modules) and the
    name -> path of adapters requests gave with a path (so that one named alone later finds
    its file; not listed)."""

    def __init__(self, served: str, takes_lora: bool) -> None:
        self.served = served
        self.takes_lora = takes_lora        # the model makes images (a DiT stage to adapt)
        self.loaded: dict[str, LoraModule] = {}
        self.created: dict[str, int] = {}
        self.known: OrderedDict[str, str] = OrderedDict()
        self.bound: OrderedDict[str, str] = OrderedDict()   # name -> the first file sent
        self._lock = threading.Lock()         # loads run in the threadpool

    def load(self, name: str, path: str, *, inplace: bool = False,
             base_model_name: str | None = None) -> str:
        """Check the file and list the adapter; vLLM's answer text. APIError as vLLM's."""
        if not self.takes_lora:
            raise bad_request("this model takes no LoRA adapters (they adapt the transformer "
                              "of an image model's diffusion stage)", "lora_name",
                              "lora_not_supported")
        if name == self.served:
            raise bad_request(f"lora_name: {name!r} is the served model's name", "lora_name")
        self._check_new(name, inplace)
        if not _exists(path):
            raise APIError(404, f"Loading lora {name} failed: No adapter found for {path}",
                           param="lora_path", code="lora_not_found")
        try:
            check_adapter(path)                 # reads the file: run off the event loop
        except (ValueError, OSError) as exc:
            raise bad_request(f"Loading lora {name} failed: {exc}", "lora_path",
                              "invalid_lora") from None
        with self._lock:
            self._check_new(name, inplace)      # (a load of the same name meanwhile)
            self.loaded[name] = LoraModule(name, path, base_model_name)
            self.created[name] = int(time.time())
            self.known.pop(name, None)
        logger.info("LoRA adapter %r loaded from %s", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def _check_new(self, name: str, inplace: bool) -> None:
        if name in self.loaded and not inplace:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.",
                              "lora_name", "lora_already_loaded")

    def unload(self, name: str) -> str:
        with self._lock:
            if self.loaded.pop(name, None) is None:
                raise APIError(404, f"The lora adapter '{name}' cannot be found.",
                               param="lora_name", code="lora_not_found")
            self.created.pop(name, None)
            self.known.pop(name, None)
        logger.info("LoRA adapter %r unloaded", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def cards(self) -> list[ModelCard]:
        """vLLM's cards of the loaded adapters: id the name, parent the base, root the path."""
        return [ModelCard(id=m.name, created=self.created[m.name], root=m.path,
                          parent=m.base_model_name or self.served)
                for m in self.loaded.values()]

    def card(self, name: str) -> ModelCard | None:
        return next((c for c in self.cards() if c.id == name), None)

    def with_adapter(self, body: Body) -> Body:
        """The body with its `model` checked (the served model, or a loaded adapter's name:
        404 otherwise) and its `lora` resolved (`resolve`); a model that takes no adapter
        leaves `lora` to the route (refused or named ignored there)."""
        if body.model is None or body.model not in self.loaded:
            check_model(body.model, self.served)
        if not self.takes_lora:
            return body
        lora = self.resolve(body.model, body.lora)
        return body if lora is body.lora else body.model_copy(update={"lora": lora})

    def resolve(self, model: str | None, lora: LoraBody | None) -> LoraBody | None:
        """The request's adapter with its path: `model` naming a loaded adapter selects it
        (scale 1 unless a `lora` object of that name says); a `lora` object without a path
        takes the path of the adapter loaded or last given under its name (400 naming
        lora.name if none); one with a path is taken as it is (and its path remembered)."""
        chosen = self.loaded.get(model) if model is not None else None
        if chosen is not None and lora is not None and lora.name != chosen.name:
            raise bad_request(f"lora.name: {lora.name!r} differs from the adapter `model` "
                              f"names ({chosen.name!r}); give one", "lora.name")
        if chosen is not None and lora is None:
            return LoraBody(name=self._stage_name(chosen.name, chosen.path), path=chosen.path)
        if lora is None:
            return None
        if lora.path is not None:
            self._remember(lora.name, lora.path)
            path = lora.path
        else:
            path = self._path_of(lora.name)
        if path is None:
            raise bad_request(f"lora.name: no adapter {lora.name!r} is loaded (loaded: "
                              f"{sorted(self.loaded)}); load it with POST "
                              "/v1/load_lora_adapter or give lora.path", "lora.name")
        return lora.model_copy(update={"name": self._stage_name(lora.name, path),
                                       "path": path})

    def _stage_name(self, name: str, path: str) -> str:
        """The name the stage holds the adapter under: `name` for the first file it was given
        with, `name@path` for any other. A stage holds one adapter per name, and a request
        running with it must not see it replaced by another file under the same name (an
        unload and a load of another file, or a request's own path)."""
        with self._lock:
            first = self.bound.setdefault(name, path)
            self.bound.move_to_end(name)
            while len(self.bound) > MAX_KNOWN:
                self.bound.popitem(last=False)
        return name if first == path else f"{name}@{path}"

    def _path_of(self, name: str) -> str | None:
        if name in self.loaded:
            return self.loaded[name].path
        if name in self.known:
            self.known.move_to_end(name)
        return self.known.get(name)

    def _remember(self, name: str, path: str) -> None:
        if name in self.loaded:
            return                          # the listed adapter stays what was loaded
        self.known[name] = path
        self.known.move_to_end(name)
        while len(self.known) > MAX_KNOWN:
            self.known.popitem(last=False)

    def load_modules(self, modules: tuple[LoraModule, ...]) -> None:
        """--lora-modules: each loaded; ValueError (the server does not start) on a failure."""
        for m in modules:
            try:
                self.load(m.name, m.path, base_model_name=m.base_model_name)
            except APIError as err:
                raise ValueError(f"--lora-modules {m.name}={m.path}: {err.message}") from None


def _exists(path: str) -> bool:
    try:
        return Path(path).exists()
    except (OSError, ValueError):     # a name too long, a NUL byte: no such file either
        return False


def add_lora_routes(app: FastAPI, loras: LoraAdapters, errors: dict[int | str, Any]) -> None:
    """vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""

    @app.post("/v1/load_lora_adapter", responses=errors, response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> PlainTextResponse:
        text = await run_in_threadpool(loras.load, body.lora_name, body.lora_path,
                                       inplace=body.load_inplace)
        return PlainTextResponse(text)

    @app.post("/v1/unload_lora_adapter", responses=errors, response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(loras.unload(body.lora_name))
