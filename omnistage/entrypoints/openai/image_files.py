"""Images answered as URLs (`response_format: "url"`, as OpenAI's DALL-E answers by default):
each image is kept in a small store in memory and served at

    GET /v1/images/files/{file_id}      the file, while it lasts (then 404)

like OpenAI's image URLs: a plain GET of an unguessable address (128 random bits), no API key
(a client hands the URL to whatever downloads it), gone after `ttl_s` (one hour, as
OpenAI's). The store is bounded: at most `max_files` images and `max_bytes` bytes; the oldest
go first when a new one needs the room. Nothing is written to disk; a restart forgets them.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.responses import Response

from omnistage.entrypoints.openai.errors import APIError, bad_request

FILES_PREFIX = "/v1/images/files/"      # served without the API key (see the docstring)
ROUTE_NAME = "image_file"


@dataclass(frozen=True, slots=True)
class StoredImage:
    data: bytes
    media_type: str
    expires_at: float


class ImageFiles:
    """The images handed out as URLs: bounded in count, bytes and time (see the module)."""

    def __init__(self, max_files: int = 256, max_bytes: int = 256 << 20,
                 ttl_s: float = 3600.0) -> None:
        if max_files < 1 or max_bytes < 1 or ttl_s <= 0:
            raise ValueError(f"ImageFiles: max_files={max_files}, max_bytes={max_bytes}, "
                             f"ttl_s={ttl_s}: each must be > 0")
        self.max_files, self.max_bytes, self.ttl_s = max_files, max_bytes, ttl_s
        self.files: OrderedDict[str, StoredImage] = OrderedDict()    # oldest first
        self.num_bytes = 0
        self.lock = threading.Lock()

    def put(self, data: bytes, media_type: str, now: float | None = None) -> str:
        """Keep one image file; -> its id. Older ones go if the store is full."""
        if len(data) > self.max_bytes:
            raise bad_request(f"response_format=url: an image of {len(data)} bytes is larger "
                              f"than this server keeps ({self.max_bytes}); use b64_json",
                              "response_format")
        now = time.time() if now is None else now
        file_id = f"img_{uuid.uuid4().hex}"
        with self.lock:
            self._expire(now)
            while self.files and (len(self.files) >= self.max_files
                                  or self.num_bytes + len(data) > self.max_bytes):
                self._drop(next(iter(self.files)))
            self.files[file_id] = StoredImage(data, media_type, now + self.ttl_s)
            self.num_bytes += len(data)
        return file_id

    def get(self, file_id: str, now: float | None = None) -> StoredImage | None:
        with self.lock:
            self._expire(time.time() if now is None else now)
            return self.files.get(file_id)

    def _expire(self, now: float) -> None:
        # stored in time order with one ttl: the expired ones are the oldest
        while self.files and next(iter(self.files.values())).expires_at <= now:
            self._drop(next(iter(self.files)))

    def _drop(self, file_id: str) -> None:
        self.num_bytes -= len(self.files.pop(file_id).data)


def add_image_file_routes(app: FastAPI, files: ImageFiles) -> None:
    @app.get(FILES_PREFIX + "{file_id}", name=ROUTE_NAME, response_class=Response)
    async def image_file(file_id: str) -> Response:
        """An image answered as a URL, while it lasts."""
        stored = files.get(file_id)
        if stored is None:
            raise APIError(404, f"no image {file_id!r}: image URLs last "
                                f"{files.ttl_s / 60:g} minutes", param="file_id",
                           code="image_not_found")
        return Response(stored.data, media_type=stored.media_type,
                        headers={"Cache-Control": "private, max-age="
                                 f"{max(0, int(stored.expires_at - time.time()))}"})
