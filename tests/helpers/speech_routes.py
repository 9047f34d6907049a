"""The speech routes as the family system tests drive them: the WebSocket fed a text word by
word (both dialects), and /v1/audio/speech/batch; each returns what the server spoke, for the
test to set against the plain route's audio."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx


def _recv(ws: Any) -> dict:
    event = json.loads(ws.recv(timeout=300))
    assert event["type"] != "error", event
    return event


def ws_speak(port: int, session: dict, text: str) -> tuple[bytes, list[str]]:
    """Our dialect: session.update, then the text a word at a time, then input.done: the
    session's pcm (one file) and each clause's text as the server cut it."""
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream", open_timeout=30,
                 max_size=None) as ws:
        ws.send(json.dumps({"type": "session.update",
                            "session": {**session, "response_format": "pcm"}}))
        assert _recv(ws)["type"] == "session.updated"
        for word in text.split(" "):
            ws.send(json.dumps({"type": "input.append", "text": word + " "}))
        ws.send(json.dumps({"type": "input.done"}))
        audio, clauses = b"", []
        while (event := _recv(ws))["type"] != "audio.done":
            if event["type"] == "audio.delta":
                audio += base64.b64decode(event["audio"])
            elif event["type"] == "clause.done":
                clauses.append(event["text"])
        assert event["clauses"] == len(clauses)
    return audio, clauses


def ws_speak_vllm(port: int, config: dict, text: str) -> list[tuple[str, bytes]]:
    """vLLM-Omni's dialect (session.config, input.text): each sentence's text and its file."""
    from websockets.sync.client import connect

    out: list[tuple[str, bytes]] = []
    with connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream", open_timeout=30,
                 max_size=None) as ws:
        ws.send(json.dumps({"type": "session.config", **config}))
        for word in text.split(" "):
            ws.send(json.dumps({"type": "input.text", "text": word + " "}))
        ws.send(json.dumps({"type": "input.done"}))
        while True:
            msg = ws.recv(timeout=300)
            if isinstance(msg, bytes):
                out[-1] = (out[-1][0], out[-1][1] + msg)
                continue
            event = json.loads(msg)
            assert "error" not in event and event["type"] != "error", event
            if event["type"] == "audio.start":
                out.append((event["sentence_text"], b""))
            elif event["type"] == "session.done":
                return out


def batch(url: str, items: list[dict], fmt: str = "wav", **body: Any) -> list[dict]:
    """/v1/audio/speech/batch: the results in item order (each its audio bytes or its error)."""
    r = httpx.post(f"{url}/v1/audio/speech/batch", json={"items": items,
                                                        "response_format": fmt, **body},
                   timeout=600)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(len(items)))
    return [{**d, "audio": base64.b64decode(d["audio"])} if d.get("audio") else d
            for d in data]
