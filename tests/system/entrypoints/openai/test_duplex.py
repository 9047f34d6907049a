"""/v1/duplex on a real server (`omnistage serve` of a tiny random Moshi with the released
codec's 80 ms frames, --max-num-seqs 2): the served session's text tokens, audio codes and
audio equal the step-by-step reference (omnistage/testing/moshi_duplex.py, on our
golden-checked model.py; transformers' Mimi for the user's codes and the reference audio) for
a scripted user's audio; two sessions at once, each equal to its own reference; output frames
arrive while the input is still being sent in real time; a dropped socket resumes with every
event it missed; bad input gets the protocol's error event and the session ticks on; a closed
socket frees its slot, and a session beyond the maximum is refused; /metrics and the final
event carry missed ticks and tick latency; /v1/realtime?duplex=1 (vLLM-Omni's path) serves
the same session; with --api-key the socket needs the key."""

from __future__ import annotations

import base64
import json
import socket
import time
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import pytest
import torch
from websockets.sync.client import ClientConnection, connect

from omnistage.models.moshi.model import MoshiForConditionalGeneration
from omnistage.testing.moshi_duplex import aligned_frames, build_duplex_moshi, duplex_reference

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL, K, FRAME, WAIT_S = "moshi-tiny", 3, 1920, 30


@pytest.fixture(scope="module")
def setup(start_server, tmp_path_factory) -> tuple[Server, Any, MoshiForConditionalGeneration]:
    path, ref = build_duplex_moshi(tmp_path_factory.mktemp("duplex") / "moshi")
    server = start_server([str(path), "--served-model-name", MODEL, "--max-num-seqs", "2",
                           "--realtime-resume-grace", "20"])
    return server, ref, MoshiForConditionalGeneration.from_pretrained(path)


def script(num: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(num * FRAME) * 0.3 * 32767).clip(
        -32768, 32767).astype("<i2")


def open_session(server: Server, query: str = "", path: str = "/v1/duplex?"
                 ) -> tuple[ClientConnection, dict[str, Any]]:
    sep = "" if path.endswith("?") else "&"
    ws = connect(f"ws://127.0.0.1:{server.port}{path}{sep}model={MODEL}{query}",
                 open_timeout=WAIT_S, max_size=None)
    created = recv(ws)
    assert created["type"] == "session.created", created
    assert recv(ws)["type"] == "response.created"
    return ws, created


def send(ws: ClientConnection, kind: str, **fields: Any) -> None:
    ws.send(json.dumps({"type": kind, **fields}))


def append(ws: ClientConnection, pcm: np.ndarray) -> None:
    send(ws, "input_audio_buffer.append", audio=base64.b64encode(pcm.tobytes()).decode())


def recv(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(ws.recv(timeout=WAIT_S))


def ticks(ws: ClientConnection, until_tick: int) -> list[dict[str, Any]]:
    """Events up to the audio delta of tick `until_tick`."""
    seen = [recv(ws)]
    while not (seen[-1]["type"] == "response.output_audio.delta"
               and seen[-1]["tick"] >= until_tick):
        seen.append(recv(ws))
    return seen


def check_reference(ref: Any, ours: MoshiForConditionalGeneration, pcm: np.ndarray,
                    events: list[dict[str, Any]]) -> None:
    """What the session heard (the script in order, silence where its input was missed)
    and what it said equal the reference's run on that audio."""
    texts = [e for e in events if e["type"] == "response.output_audio_transcript.delta"]
    audio = [e for e in events if e["type"] == "response.output_audio.delta"]
    frames, used = [], 0
    for e in texts[1:]:
        assert e["heard"] is True
        if e["input_missed"]:
            frames.append(np.zeros(FRAME, "<i2"))
        else:
            frames.append(pcm[used * FRAME:(used + 1) * FRAME])
            used += 1
    assert used >= 4, "the scripted audio was heard"
    heard = torch.from_numpy(np.concatenate(frames).astype(np.float32) / 32768.0)
    with torch.no_grad():
        user = ref.audio_encoder.encode(heard.view(1, 1, -1), num_quantizers=K).audio_codes[0]
    text, steps = duplex_reference(ours, user)
    assert [e["token_id"] for e in texts] == text.tolist()
    assert [e["tick"] for e in audio] == list(range(1, len(texts)))
    codes = torch.tensor([e["codes"] for e in audio])
    assert torch.equal(codes, aligned_frames(steps))
    with torch.no_grad():
        want = ref.audio_encoder.decode(codes.T[None]).audio_values[0, 0]
    got = np.concatenate([np.frombuffer(base64.b64decode(e["delta"]), "<i2") for e in audio])
    assert want.abs().max() > 0.1
    torch.testing.assert_close(torch.from_numpy(got.astype(np.float32) / 32767), want.clamp(
        -1, 1), atol=2e-4, rtol=0)


def close(ws: ClientConnection) -> dict[str, Any]:
    send(ws, "session.close")
    while (ev := recv(ws))["type"] != "session.ended":
        pass
    ws.close()
    return ev


def test_session_equals_reference_and_final_event(setup):
    server, ref, ours = setup
    ws, created = open_session(server)
    assert created["session"]["audio"]["input"]["format"] == {"type": "audio/pcm",
                                                              "rate": 24000}
    pcm = script(8, 1)
    append(ws, pcm)
    events = ticks(ws, 10)
    check_reference(ref, ours, pcm, events)
    ended = close(ws)
    assert ended["reason"] == "client_closed"
    stats = ended["stats"]
    assert stats["ticks"] >= 11 and stats["missed_inputs"] >= 2     # the script ran out
    assert 0 < stats["tick_latency_ms_p50"] <= stats["tick_latency_ms_max"]


def test_two_sessions_at_once_each_equal_its_reference(setup):
    server, ref, ours = setup
    before = server.metrics()[("omnistage_duplex_ticks_total", (("model_name", MODEL),))]
    (a, _), (b, _) = open_session(server), open_session(server)
    pcm_a, pcm_b = script(6, 2), script(6, 3)
    append(a, pcm_a)
    append(b, pcm_b)
    events_a, events_b = ticks(a, 8), ticks(b, 8)
    check_reference(ref, ours, pcm_a, events_a)
    check_reference(ref, ours, pcm_b, events_b)
    ended = [close(a)["stats"]["ticks"], close(b)["stats"]["ticks"]]
    steps = server.metrics()[("omnistage_duplex_ticks_total", (("model_name", MODEL),))]
    # one step ticks both: far fewer steps than the two sessions' ticks
    assert steps - before <= sum(ended) - min(ended) // 2, (steps - before, ended)


def test_output_arrives_while_input_is_sent(setup):
    server, _, _ = setup
    ws, _ = open_session(server)
    pcm, early = script(15, 4), []
    for i in range(15):                                  # real time: one frame per 80 ms
        append(ws, pcm[i * FRAME:(i + 1) * FRAME])
        deadline = time.monotonic() + 0.08
        while (left := deadline - time.monotonic()) > 0:
            try:
                ev = json.loads(ws.recv(timeout=left))
            except TimeoutError:
                break
            if ev["type"] == "response.output_audio.delta" and i < 14:
                early.append(ev["tick"])
    assert len(early) >= 3, f"audio deltas before the last input frame: {early}"
    assert close(ws)["stats"]["ticks"] >= 10


def test_a_dropped_socket_resumes_with_what_it_missed(setup):
    server, _, _ = setup
    ws, created = open_session(server)
    append(ws, script(20, 5))
    seen = ticks(ws, 3)
    last = seen[-1]["server_event_seq"]
    ws.socket.shutdown(socket.SHUT_RDWR)                # the network goes: no close frame
    ws.socket.close()
    time.sleep(0.5)                                     # ticks go on while it is away
    again = connect(f"ws://127.0.0.1:{server.port}/v1/duplex?resume=1", open_timeout=WAIT_S,
                    max_size=None)
    send(again, "session.resume", session_id=created["session"]["id"],
         resume_token=created["resume_token"], last_received_server_event_seq=last)
    resumed = recv(again)
    assert resumed["type"] == "session.resumed", resumed
    after = ticks(again, seen[-1]["tick"] + 8)
    assert [e["server_event_seq"] for e in after] == list(range(last + 1, last + 1 + len(after)))
    audio_ticks = [e["tick"] for e in after if e["type"] == "response.output_audio.delta"]
    assert audio_ticks == list(range(seen[-1]["tick"] + 1, audio_ticks[-1] + 1))
    assert close(again)["reason"] == "client_closed"


def test_bad_input_gets_error_events_and_the_session_goes_on(setup):
    server, _, _ = setup
    ws, _ = open_session(server)
    cases = [("not json", "invalid_json"),
             (json.dumps({"type": "response.create"}), "unknown_event"),
             (json.dumps({"type": "input_audio_buffer.append", "audio": "%%%"}), "invalid_audio"),
             (json.dumps({"type": "input_audio_buffer.append",
                          "audio": base64.b64encode(b"abc").decode()}), "invalid_audio_format"),
             (json.dumps({"type": "input_audio_buffer.append",
                          "audio": base64.b64encode(bytes(300 << 10)).decode()}),
              "audio_chunk_too_large"),
             (json.dumps({"type": "session.update", "session": {"audio": {"input": {
                 "format": {"type": "audio/pcm", "rate": 16000}}}}}), "invalid_audio_format"),
             (b"\x00\x01", "invalid_json"), ("x" * (2 << 20), "event_too_large")]
    for frame, code in cases:
        ws.send(frame)
        while (ev := recv(ws))["type"] != "error":
            pass
        assert ev["error"]["code"] == code, (code, ev)
    for _ in range(4):                                   # 4 x 5.3 s > the 20 s buffer
        append(ws, np.zeros(250 << 9, "<i2"))
    while (ev := recv(ws))["type"] != "error":
        pass
    assert ev["error"]["code"] == "input_audio_buffer_full"
    send(ws, "input_audio_buffer.clear")
    while recv(ws)["type"] != "input_audio_buffer.cleared":
        pass
    tick = ticks(ws, 0)[-1]["tick"]
    assert ticks(ws, tick + 2)[-1]["tick"] == tick + 2  # still ticking
    close(ws)


def test_disconnect_frees_the_slot_and_the_maximum_is_enforced(setup):
    server, _, _ = setup
    gauge = ("omnistage_duplex_sessions", (("model_name", MODEL),))
    (a, created), (b, _) = open_session(server), open_session(server)
    ticks(a, 2)
    sid = created["session"]["id"]
    missed = server.metrics()[("omnistage_duplex_session_missed_ticks",
                               (("model_name", MODEL), ("session_id", sid)))]
    assert missed >= 0 and server.metrics()[gauge] == 2
    third = connect(f"ws://127.0.0.1:{server.port}/v1/duplex", open_timeout=WAIT_S)
    refused = recv(third)
    assert refused["type"] == "error" and refused["error"]["code"] == "session_limit_reached"
    third.close()
    a.close()                                            # a clean close: no grace period
    deadline = time.monotonic() + WAIT_S
    while server.metrics()[gauge] != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metrics()[gauge] == 1
    c, _ = open_session(server)                          # the freed slot serves a new one
    ticks(c, 1)
    close(b), close(c)
    metrics = server.metrics()
    assert metrics[gauge] == 0
    assert metrics[("omnistage_duplex_tick_latency_seconds_count",
                    (("model_name", MODEL),))] > 0


def test_vllm_omni_path_and_a_session_not_resumed_in_its_grace_is_freed(setup):
    server, _, _ = setup
    gauge = ("omnistage_duplex_sessions", (("model_name", MODEL),))
    ws, created = open_session(server, "&resume_grace_s=0.3", path="/v1/realtime?duplex=1")
    assert created["session"]["duplex"]["frame_samples"] == FRAME
    ticks(ws, 1)
    assert server.metrics()[gauge] == 1
    ws.socket.shutdown(socket.SHUT_RDWR)                # dropped, never resumed
    ws.socket.close()
    deadline = time.monotonic() + WAIT_S
    while server.metrics()[gauge] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metrics()[gauge] == 0
    late = connect(f"ws://127.0.0.1:{server.port}/v1/duplex?resume=1", open_timeout=WAIT_S)
    send(late, "session.resume", session_id=created["session"]["id"],
         resume_token=created["resume_token"], last_received_server_event_seq=0)
    assert recv(late)["error"]["code"] == "session_resume_expired"
    late.close()


def test_the_api_key_guards_the_socket(setup, start_server):
    server, _, _ = setup
    path = server.proc.args[server.proc.args.index("serve") + 1]
    guarded = start_server([path, "--served-model-name", MODEL], api_key="duplex-key")
    url = f"ws://127.0.0.1:{guarded.port}/v1/duplex?model={MODEL}"
    with pytest.raises(Exception, match="403"):
        connect(url, open_timeout=WAIT_S)
    assert httpx.get(f"{guarded.url}/metrics").status_code == 401
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    with connect(url, open_timeout=WAIT_S,
                 additional_headers={"Authorization": "Bearer duplex-key"}) as ws:
        assert recv(ws)["type"] == "session.created"
    with connect(url, open_timeout=WAIT_S,     # a browser's way: OpenAI's subprotocol
                 subprotocols=["realtime", "openai-insecure-api-key.duplex-key"]) as ws:
        assert recv(ws)["type"] == "session.created"


def test_sampling_from_the_query_and_bad_values_refused_by_name(setup):
    """`temperature`, `top_k`, `audio_temperature`, `audio_top_k`, `seed` in the socket's
    query choose the session's sampling (protocol.sampling_of); a bad one is an error event
    naming it and the socket closes (1008); the server keeps serving."""
    server, _, _ = setup
    for query, param in (("&audio_temperature=hot", "audio_temperature"),
                         ("&top_k=-3", "top_k"), ("&temperature=9", "temperature")):
        ws = connect(f"ws://127.0.0.1:{server.port}/v1/duplex?model={MODEL}{query}",
                     open_timeout=WAIT_S)
        ev = recv(ws)
        assert ev["type"] == "error" and ev["error"]["param"] == param, ev
        ws.close()
    ws, _ = open_session(server, "&temperature=0.9&top_k=20&audio_temperature=0.8"
                                 "&audio_top_k=50&seed=4")
    append(ws, script(3, 5))
    assert ticks(ws, 3)[-1]["tick"] == 3
    close(ws)
