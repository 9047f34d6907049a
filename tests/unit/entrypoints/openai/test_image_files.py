"""The store behind `response_format: "url"` (image_files.py): bounded in count and bytes,
the oldest going first, each image gone after its time; and the route's answers."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI

from omnistage.entrypoints.openai.errors import APIError, install_error_handlers
from omnistage.entrypoints.openai.image_files import ImageFiles, add_image_file_routes


def test_the_oldest_go_first_when_the_count_is_full() -> None:
    files = ImageFiles(max_files=2, ttl_s=60)
    a, b, c = (files.put(bytes([i]) * 10, "image/png", now=0) for i in range(3))
    assert files.get(a, now=1) is None
    assert files.get(b, now=1).data == b"\x01" * 10 and files.get(c, now=1).data == b"\x02" * 10
    assert len({a, b, c}) == 3 and all(x.startswith("img_") for x in (a, b, c))


def test_the_oldest_go_first_when_the_bytes_are_full() -> None:
    files = ImageFiles(max_files=10, max_bytes=25, ttl_s=60)
    a = files.put(b"a" * 10, "image/png", now=0)
    b = files.put(b"b" * 10, "image/png", now=0)
    c = files.put(b"c" * 10, "image/jpeg", now=0)          # 30 > 25: a goes
    assert files.get(a, now=0) is None and files.num_bytes == 20
    assert files.get(b, now=0) is not None and files.get(c, now=0).media_type == "image/jpeg"


def test_images_expire() -> None:
    files = ImageFiles(ttl_s=10)
    a = files.put(b"x", "image/png", now=0)
    b = files.put(b"y", "image/png", now=5)
    assert files.get(a, now=9.9) is not None
    assert files.get(a, now=10) is None and files.get(b, now=10) is not None
    assert files.get(b, now=15) is None and files.num_bytes == 0 and not files.files


def test_an_image_larger_than_the_store_is_a_400() -> None:
    with pytest.raises(APIError) as exc:
        ImageFiles(max_bytes=4).put(b"12345", "image/png")
    assert exc.value.status == 400 and exc.value.param == "response_format"
    with pytest.raises(ValueError, match="max_files=0"):
        ImageFiles(max_files=0)


def test_the_route_serves_them_and_404s_the_rest() -> None:
    app = FastAPI()
    install_error_handlers(app)
    files = ImageFiles()
    add_image_file_routes(app, files)
    file_id = files.put(b"\x89PNG-ish", "image/png")

    async def get(path: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as client:
            return await client.get(path)

    r = asyncio.run(get(f"/v1/images/files/{file_id}"))
    assert r.status_code == 200 and r.content == b"\x89PNG-ish"
    assert r.headers["content-type"] == "image/png"
    missing = asyncio.run(get("/v1/images/files/img_nope"))
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "image_not_found"
