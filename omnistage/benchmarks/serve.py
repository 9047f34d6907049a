"""`omnistage bench serve`: load any OpenAI-compatible server with synthetic requests and time
them from the client, as `vllm bench serve` does. No model, no torch: httpx and the stdlib.

    --endpoint-type  route                    what each request records
    chat             /v1/chat/completions     streamed (SSE): TTFT = the first content delta,
    completions      /v1/completions          ITL = the gaps between deltas, TPOT = (E2E - TTFT)
                                              / (output tokens - 1); tokens from the usage chunk
                                              (stream_options.include_usage), else deltas counted
    chat-audio       /v1/chat/completions     modalities [text, audio], pcm16 in delta.audio: the
                                              above for the transcript, first audio, RTF
    speech           /v1/audio/speech         wav or pcm as the server streams it: the first
                                              audio byte, RTF = E2E / seconds of audio received
    images           /v1/images/generations   E2E latency; images per second overall

Requests arrive all at once (`request_rate` inf) or as a Poisson process of that rate (seeded),
with at most `max_concurrency` in flight. Every request has a deadline; one that fails (an HTTP
error, an `error` event, a cut stream, the deadline) is counted with its error and never stops
the run. Times are seconds in a `Sample`, milliseconds in the summary (vLLM's keys:
`mean_ttft_ms`, `p99_itl_ms`, ...); RTF has no unit.
"""


from __future__ import annotations

import asyncio
import base64
import json
import math
import random
import struct
import time
from dataclasses import asdict

from omnistage.benchmarks.serve_config import (ALIASES, DEFAULT_INPUT_WORDS, DEFAULT_METRICS,
                                               METRICS, ROUTES, WORDS, RequestFailed, Sample,
                                               ServeBenchConfig)
from omnistage.benchmarks.serve_report import metric_values, percentile, summarize, table

# the config, the sample and the summary live in serve_config / serve_report; importable here
__all__ = ["ALIASES", "DEFAULT_INPUT_WORDS", "DEFAULT_METRICS", "METRICS", "ROUTES", "WORDS",
           "RequestFailed", "Sample", "ServeBenchConfig", "benchmark", "metric_values",
           "percentile", "prompts", "request_body", "run", "summarize", "table", "wav_layout"]


# -- requests ------------------------------------------------------------------------------------

def prompts(cfg: ServeBenchConfig, rng: random.Random) -> list[str]:
    if cfg.prompt is not None:
        return [cfg.prompt] * cfg.num_prompts
    n = cfg.random_input_len or DEFAULT_INPUT_WORDS[cfg.endpoint_type]
    return [" ".join(rng.choice(WORDS) for _ in range(n)) for _ in range(cfg.num_prompts)]


def request_body(cfg: ServeBenchConfig, model: str, prompt: str) -> dict:
    etype = cfg.endpoint_type
    if etype == "speech":
        body = {"model": model, "input": prompt, "response_format": cfg.audio_format}
        return {**body, "voice": cfg.voice} if cfg.voice else body
    if etype == "images":
        body = {"model": model, "prompt": prompt, "n": 1, "response_format": "b64_json"}
        return {**body, "size": cfg.image_size} if cfg.image_size else body
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": cfg.random_output_len}
    if etype == "completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    if etype == "chat-audio":
        body["modalities"] = ["text", "audio"]
        body["audio"] = {"format": "pcm16", **({"voice": cfg.voice} if cfg.voice else {})}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


def _failure(status: int, text: str) -> RequestFailed:
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text[:300]
    return RequestFailed(f"HTTP {status}: {message}")


async def _stream_sse(http, url: str, body: dict, s: Sample, t0: float, rate: int) -> None:
    """A streamed chat / completions answer: text deltas (content, text, or the transcript of
    delta.audio) and pcm16 pieces, timed as they arrive."""
    pcm_bytes, last, counted, reported = 0, 0.0, 0, None
    async with http.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise _failure(resp.status_code, (await resp.aread()).decode(errors="replace"))
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                raise RequestFailed(f"error event: {chunk['error'].get('message', chunk)}")
            now = time.perf_counter() - t0
            if chunk.get("usage"):
                s.prompt_tokens = chunk["usage"].get("prompt_tokens")
                reported = chunk["usage"].get("completion_tokens")
            if not chunk.get("choices"):
                continue
            choice = chunk["choices"][0]
            delta = choice.get("delta") or {}
            audio = delta.get("audio") or {}
            text = choice.get("text") or delta.get("content") or audio.get("transcript")
            if text:
                if s.ttft_s is None:
                    s.ttft_s = now
                else:
                    s.itl_s.append(now - last)
                last, counted = now, counted + 1
            if audio.get("data"):
                s.first_audio_s = now if s.first_audio_s is None else s.first_audio_s
                pcm_bytes += len(base64.b64decode(audio["data"]))
    s.output_tokens = reported if reported is not None else counted
    s.audio_s = pcm_bytes / 2 / rate


def wav_layout(head: bytes) -> tuple[int, int, int] | None:
    """(offset of the samples, sample rate, bytes per frame) of a wav's header, or None while
    `head` ends before its data chunk starts. The data chunk's size is not read: a streamed wav
    says "length unknown"."""
    if len(head) < 12:
        return None
    if head[:4] not in (b"RIFF", b"RF64") or head[8:12] != b"WAVE":
        raise RequestFailed(f"not a wav file: starts {head[:12]!r}")
    pos, rate, frame = 12, 0, 0
    while pos + 8 <= len(head):
        cid, size = head[pos:pos + 4], struct.unpack_from("<I", head, pos + 4)[0]
        if cid == b"data":
            if not frame:
                raise RequestFailed("wav data before its fmt chunk")
            return pos + 8, rate, frame
        if pos + 8 + size > len(head):
            return None
        if cid == b"fmt ":
            _, _, rate, _, frame = struct.unpack_from("<HHIIH", head, pos + 8)
        pos += 8 + size + (size & 1)
    return None


async def _stream_speech(http, url: str, body: dict, s: Sample, t0: float, fmt: str,
                         rate: int) -> None:
    """/v1/audio/speech: bytes of one file as the server sends them; the first audio is the
    first byte of samples (past a wav's header)."""
    layout = (0, rate, 2) if fmt == "pcm" else None
    total = 0
    head = bytearray()
    async with http.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise _failure(resp.status_code, (await resp.aread()).decode(errors="replace"))
        async for piece in resp.aiter_bytes():
            total += len(piece)
            if layout is None:
                head += piece
                layout = wav_layout(bytes(head))
                if layout is None and len(head) > 1 << 16:
                    raise RequestFailed("no wav data chunk in the first 64 KiB")
            if layout is not None and s.first_audio_s is None and total > layout[0]:
                s.first_audio_s = time.perf_counter() - t0
    if layout is None:
        raise RequestFailed(f"the answer ended inside its wav header ({total} bytes)")
    offset, rate, frame = layout
    s.audio_s = (total - offset) // frame / rate
    if s.audio_s <= 0:
        raise RequestFailed("no audio in the answer")


async def _images(http, url: str, body: dict, s: Sample) -> None:
    resp = await http.post(url, json=body)
    if resp.status_code != 200:
        raise _failure(resp.status_code, resp.text)
    s.images = len(resp.json()["data"])
    if s.images == 0:
        raise RequestFailed("no images in the answer")


async def send(http, cfg: ServeBenchConfig, model: str, s: Sample, prompt: str,
               t0: float) -> None:
    """One request into `s`; its failure recorded there, never raised."""
    import httpx

    url = cfg.root + (cfg.endpoint or ROUTES[cfg.endpoint_type])
    body = request_body(cfg, model, prompt)
    start = time.perf_counter()
    s.start_s = start - t0
    if cfg.endpoint_type == "speech":
        work = _stream_speech(http, url, body, s, start, cfg.audio_format, cfg.audio_sample_rate)
    elif cfg.endpoint_type == "images":
        work = _images(http, url, body, s)
    else:
        work = _stream_sse(http, url, body, s, start, cfg.audio_sample_rate)
    try:
        await asyncio.wait_for(work, cfg.timeout_s)
        s.success = True
    except TimeoutError:
        s.error = f"no complete answer in {cfg.timeout_s:g} s (--timeout)"
    except (httpx.HTTPError, RequestFailed, ValueError, KeyError, TypeError,
            AttributeError) as exc:
        s.error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RequestFailed) \
            else str(exc)
    s.latency_s = time.perf_counter() - start


async def first_model(http, cfg: ServeBenchConfig) -> str:
    resp = await http.get(cfg.root + "/v1/models")
    if resp.status_code != 200:
        raise RuntimeError(f"GET /v1/models: {_failure(resp.status_code, resp.text)} "
                           "(pass --model)")
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError("GET /v1/models lists no model (pass --model)")
    return data[0]["id"]


async def benchmark(cfg: ServeBenchConfig) -> tuple[str, list[Sample], float]:
    """(the model, every request's sample, the benchmark's seconds)."""
    import httpx

    rng = random.Random(cfg.seed)
    texts = prompts(cfg, rng)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    width = cfg.max_concurrency or cfg.num_prompts
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    async with httpx.AsyncClient(headers=headers, timeout=cfg.timeout_s, limits=limits) as http:
        try:
            model = cfg.model or await first_model(http, cfg)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"{cfg.root}: {type(exc).__name__}: {exc}") from None
        gate = asyncio.Semaphore(width)
        samples = [Sample(i, len(p.split())) for i, p in enumerate(texts)]

        async def one(s: Sample, prompt: str) -> None:
            async with gate:
                await send(http, cfg, model, s, prompt, t0)

        t0 = time.perf_counter()
        tasks = []
        for s, prompt in zip(samples, texts):
            if tasks and math.isfinite(cfg.request_rate):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
            tasks.append(asyncio.create_task(one(s, prompt)))
        await asyncio.gather(*tasks)
        return model, samples, time.perf_counter() - t0


def run(cfg: ServeBenchConfig) -> dict:
    """The benchmark, as one JSON-ready dict: what was asked, the summary, every sample."""
    model, samples, duration_s = asyncio.run(benchmark(cfg))
    config = asdict(cfg)
    config["request_rate"] = cfg.request_rate if math.isfinite(cfg.request_rate) else "inf"
    config["percentile_metrics"] = list(cfg.metrics)
    config.pop("api_key")
    return {"benchmark": "serve", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "base_url": cfg.root, "endpoint": cfg.endpoint or ROUTES[cfg.endpoint_type],
            "model": model, "config": config, "summary": summarize(cfg, samples, duration_s),
            "samples": [{**asdict(s), "tpot_s": s.tpot_s, "rtf": s.rtf} for s in samples]}
