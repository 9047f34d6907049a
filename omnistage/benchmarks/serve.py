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
import statistics
import struct
import time
from dataclasses import asdict, dataclass, field

ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
          "chat-audio": "/v1/chat/completions", "speech": "/v1/audio/speech",
          "images": "/v1/images/generations"}
ALIASES = {"openai-chat": "chat", "openai": "completions", "vllm": "completions"}  # vLLM's names
METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency",
           "ttfa": "Time to First Audio", "rtf": "Real-time Factor"}
DEFAULT_METRICS = {"chat": ("ttft", "tpot", "itl", "e2el"),
                   "completions": ("ttft", "tpot", "itl", "e2el"),
                   "chat-audio": ("ttft", "ttfa", "rtf", "e2el"),
                   "speech": ("ttfa", "rtf", "e2el"), "images": ("e2el",)}
DEFAULT_INPUT_WORDS = {"chat": 1024, "completions": 1024, "chat-audio": 64, "speech": 32,
                       "images": 16}
WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head "
         "house service friend father power hour game line end member law car city name "
         "river music light tree garden window market table road paper voice color").split()


@dataclass(frozen=True, slots=True)
class ServeBenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint_type: str = "chat"
    endpoint: str | None = None              # the route's path (default: the type's)
    model: str | None = None                 # None: the first of /v1/models
    num_prompts: int = 100
    max_concurrency: int | None = None       # None: no bound
    request_rate: float = math.inf           # requests per second; inf: all at once
    seed: int = 0
    random_input_len: int | None = None      # words (default: by endpoint type)
    random_output_len: int = 128             # max_tokens of text routes
    prompt: str | None = None                # the same prompt for every request
    ignore_eos: bool = True                  # vLLM's extra field: every answer max_tokens long
    api_key: str | None = None
    timeout_s: float = 600.0                 # per request, all of it
    voice: str | None = None
    audio_format: str = "wav"                # speech: wav or pcm
    audio_sample_rate: int = 24000           # the rate of headerless pcm (OpenAI's pcm16)
    image_size: str | None = None
    percentile_metrics: tuple[str, ...] | None = None   # None: by endpoint type
    metric_percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)

    def __post_init__(self) -> None:
        """Checked here, named by the flag that sets each field."""
        etype = ALIASES.get(self.endpoint_type, self.endpoint_type)
        if etype not in ROUTES:
            raise ValueError(f"--endpoint-type {self.endpoint_type!r}: choose one of "
                             f"{', '.join(ROUTES)}")
        object.__setattr__(self, "endpoint_type", etype)
        checks = [
            (self.base_url.startswith(("http://", "https://")),
             f"--base-url {self.base_url!r}: expected http://HOST:PORT or https://..."),
            (self.num_prompts >= 1, f"--num-prompts {self.num_prompts}: must be >= 1"),
            (self.max_concurrency is None or self.max_concurrency >= 1,
             f"--max-concurrency {self.max_concurrency}: must be >= 1"),
            (self.request_rate > 0, f"--request-rate {self.request_rate}: must be > 0"),
            (self.random_input_len is None or self.random_input_len >= 1,
             f"--random-input-len {self.random_input_len}: must be >= 1"),
            (self.random_output_len >= 1,
             f"--random-output-len {self.random_output_len}: must be >= 1"),
            (self.timeout_s > 0, f"--timeout {self.timeout_s}: must be > 0"),
            (self.audio_format in ("wav", "pcm"),
             f"--audio-format {self.audio_format!r}: wav or pcm (the lengths read here)"),
            (self.audio_sample_rate > 0, f"--audio-sample-rate {self.audio_sample_rate}: > 0"),
            (all(m in METRICS for m in self.metrics),
             f"--percentile-metrics {','.join(self.metrics)}: choose from {','.join(METRICS)}"),
            (all(0 < p <= 100 for p in self.metric_percentiles),
             f"--metric-percentiles {self.metric_percentiles}: each in (0, 100]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def metrics(self) -> tuple[str, ...]:
        return self.percentile_metrics or DEFAULT_METRICS[self.endpoint_type]

    @property
    def root(self) -> str:
        """The server's root: a trailing / and /v1 dropped (both spellings are common)."""
        url = self.base_url.rstrip("/")
        return url.removesuffix("/v1")


@dataclass(slots=True)
class Sample:
    """One request, timed from when it was sent (seconds)."""
    index: int
    prompt_words: int
    start_s: float = 0.0                     # when it was sent, after the benchmark's start
    success: bool = False
    error: str = ""
    latency_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    first_audio_s: float | None = None
    audio_s: float = 0.0
    images: int = 0

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def rtf(self) -> float | None:
        return self.latency_s / self.audio_s if self.audio_s > 0 else None


class RequestFailed(Exception):
    """The server answered, but not with what the route promises."""


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


# -- the summary ---------------------------------------------------------------------------------

def percentile(values: list[float], p: float) -> float:
    """numpy's default (linear between the closest ranks)."""
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def metric_values(metric: str, ok: list[Sample]) -> list[float]:
    """The metric over the successful requests, in ms (RTF: as it is)."""
    if metric == "itl":
        return [x * 1000 for s in ok for x in s.itl_s]
    get = {"ttft": lambda s: s.ttft_s, "tpot": lambda s: s.tpot_s, "e2el": lambda s: s.latency_s,
           "ttfa": lambda s: s.first_audio_s, "rtf": lambda s: s.rtf}[metric]
    scale = 1 if metric == "rtf" else 1000
    return [v * scale for v in map(get, ok) if v is not None]


def _key(metric: str, stat: str) -> str:
    return f"{stat}_{metric}" if metric == "rtf" else f"{stat}_{metric}_ms"


def _pname(p: float) -> str:
    return str(int(p)) if p == int(p) else str(p)


def summarize(cfg: ServeBenchConfig, samples: list[Sample], duration_s: float) -> dict:
    ok = [s for s in samples if s.success]
    failed = [s for s in samples if not s.success]
    n_in = sum(s.prompt_tokens or 0 for s in ok)
    n_out = sum(s.output_tokens for s in ok)
    audio_s = sum(s.audio_s for s in ok)
    images = sum(s.images for s in ok)
    out: dict = {
        "completed": len(ok), "failed": len(failed),
        "first_error": f"request {failed[0].index}: {failed[0].error}" if failed else None,
        "duration_s": duration_s,
        "max_concurrency": cfg.max_concurrency,
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf",
        "request_throughput": len(ok) / duration_s,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "output_throughput": n_out / duration_s,
        "total_token_throughput": (n_in + n_out) / duration_s,
        "total_audio_s": audio_s, "audio_throughput": audio_s / duration_s,
        "total_images": images, "image_throughput": images / duration_s,
    }
    for metric in cfg.metrics:
        values = metric_values(metric, ok)
        stats = {"mean": statistics.fmean, "median": statistics.median,
                 "std": statistics.pstdev}
        for stat, fn in stats.items():
            out[_key(metric, stat)] = fn(values) if values else None
        for p in cfg.metric_percentiles:
            out[_key(metric, f"p{_pname(p)}")] = percentile(values, p) if values else None
    return out


def table(cfg: ServeBenchConfig, summary: dict) -> str:
    """vLLM's labelled table: `Label:` padded to 40, the value after."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: object) -> None:
        if value is None:
            lines.append(f"{label:<40} {'n/a':<10}")
        elif isinstance(value, int):
            lines.append(f"{label:<40} {value:<10}")
        else:
            lines.append(f"{label:<40} {value:<10.2f}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    if cfg.max_concurrency is not None:
        row("Maximum request concurrency:", cfg.max_concurrency)
    if math.isfinite(cfg.request_rate):
        row("Request rate configured (RPS):", cfg.request_rate)
    row("Benchmark duration (s):", summary["duration_s"])
    text = cfg.endpoint_type in ("chat", "completions", "chat-audio")
    if text:
        row("Total input tokens:", summary["total_input_tokens"])
        row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    if text:
        row("Output token throughput (tok/s):", summary["output_throughput"])
        row("Total Token throughput (tok/s):", summary["total_token_throughput"])
    if cfg.endpoint_type in ("speech", "chat-audio"):
        row("Total audio (s):", summary["total_audio_s"])
        row("Audio throughput (audio s/s):", summary["audio_throughput"])
    if cfg.endpoint_type == "images":
        row("Total images:", summary["total_images"])
        row("Image throughput (images/s):", summary["image_throughput"])
    for metric in cfg.metrics:
        lines.append("{s:{c}^{n}}".format(s=METRICS[metric], n=50, c="-"))
        name = metric.upper()
        unit = "" if metric == "rtf" else " (ms)"
        row(f"Mean {name}{unit}:", summary[_key(metric, "mean")])
        row(f"Median {name}{unit}:", summary[_key(metric, "median")])
        for p in cfg.metric_percentiles:
            row(f"P{_pname(p)} {name}{unit}:", summary[_key(metric, f"p{_pname(p)}")])
    lines.append("=" * 50)
    return "\n".join(lines)


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
