"""Real servers for the HTTP tests: `omnistage serve` as a subprocess on a free localhost port,
waited on through /health. Two are shared by every module here (started together, once):

    text_server    the tiny random Qwen3 (chat template from the tiny tokenizer), API key KEY,
                   --max-queue 4, --max-model-len 512
    image_server   the built-in demo model (handwritten digits), no API key, the same
                   --allowed-media-dirs

and `omni_server` (the tiny random Qwen3-Omni) by the modules that ask for it; for the
playground's tests, one headless Chromium (`browser`) and where its screenshots go.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from omnistage.testing.processes import free_port

REPO = Path(__file__).resolve().parents[4]
KEY = "test-key-123"
CHAT_MODEL = "tiny-chat"
START_TIMEOUT_S = 180


class Server:
    def __init__(self, args: list[str], log: Path, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = log
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "omnistage.entrypoints.cli.main", "serve", *args,
               "--port", str(self.port), "--device", "cpu", "--log-level", "warning"]
        if api_key:
            cmd += ["--api-key", api_key]
        self._log_file = open(log, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log_file,
                                     stderr=subprocess.STDOUT)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self) -> Server:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"server not ready in {START_TIMEOUT_S} s:\n"
                           f"{self.log.read_text()[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log_file.close()
        return self.proc.returncode

    # -- helpers ---------------------------------------------------------------------------------
    def openai(self, **kw: object):
        from openai import OpenAI

        kw = {"api_key": self.api_key or "none", "max_retries": 0, "timeout": 60, **kw}
        return OpenAI(base_url=f"{self.url}/v1", **kw)

    def post(self, path: str, **kw: object) -> httpx.Response:
        headers = {**self.headers, **kw.pop("headers", {})}  # type: ignore[dict-item]
        kw.setdefault("timeout", 60)
        return httpx.post(f"{self.url}{path}", headers=headers, **kw)

    def get(self, path: str, **kw: object) -> httpx.Response:
        headers = {**self.headers, **kw.pop("headers", {})}  # type: ignore[dict-item]
        return httpx.get(f"{self.url}{path}", headers=headers, timeout=60, **kw)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """(sample name, sorted labels) -> value."""
        text = self.get("/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture(scope="package")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="package")
def servers(tiny_qwen3: Path, media_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("server-logs")
    started = {
        "text": Server([str(tiny_qwen3), "--served-model-name", CHAT_MODEL, "--max-queue", "4",
                        "--max-model-len", "512", "--max-body-bytes", str(1 << 20),
                        "--allowed-media-dirs", str(media_dir),
                        "--stage-override", f"llm.ar.kv_cache.cpu_kv_cache_bytes={16 << 20}"],
                       logs / "text.log", api_key=KEY),
        "image": Server(["--allowed-media-dirs", str(media_dir)], logs / "image.log"),
    }
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        codes = {name: server.stop() for name, server in started.items()}
    assert all(code == 0 for code in codes.values()), codes


@pytest.fixture(scope="package")
def omni_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny random Qwen3-Omni as `tiny-omni`: a greedy thinker that never stops early (an
    answer lasts its max tokens), a talker that samples at least 8 frames (its random codec
    head can otherwise draw its end at the first step: a spoken answer without a sample), and
    realtime session limits small enough to test."""
    from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

    path = build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny_omni"))
    server = Server([str(path), "--served-model-name", "tiny-omni",
                     "--stage-override", "thinker.ar.sampling.temperature=0",
                     "--stage-override", "thinker.ar.sampling.ignore_eos=true",
                     "--stage-override", "talker.ar.sampling.min_tokens=8",
                     "--realtime-idle-timeout", "3", "--realtime-max-turn", "3",
                     "--realtime-max-buffer-bytes", "200000"],
                    tmp_path_factory.mktemp("omni-log") / "omni.log")
    try:
        yield server.wait_ready()
    finally:
        code = server.stop()
    assert code == 0, code


@pytest.fixture(scope="package")
def agent_server(qwen3_tts_ref: dict, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Server]:
    """The voice agent graph (configs/voice_agent.yaml) as `agent`: the tiny Qwen3 LLM, greedy
    and never stopping early (an answer lasts its max tokens), spoken by the tiny Qwen3-TTS
    CustomVoice checkpoint; shared by the chat and the realtime modules."""
    from omnistage.testing.tiny_models import build_tiny_checkpoint

    llm = build_tiny_checkpoint(tmp_path_factory.mktemp("agent_llm"), "Qwen3ForCausalLM")
    tts: Path = qwen3_tts_ref["root"] / "custom_voice"
    server = Server([str(llm), "--served-model-name", "agent", "--stage-config", "voice_agent",
                     "--stage-override", f"talker.model={tts}",
                     "--stage-override", f"code2wav.model={tts}",
                     "--stage-override", "llm.ar.sampling.temperature=0",
                     "--stage-override", "llm.ar.sampling.ignore_eos=true"],
                    tmp_path_factory.mktemp("agent-log") / "agent.log")
    try:
        yield server.wait_ready()
    finally:
        code = server.stop()
    assert code == 0, code


@pytest.fixture(scope="module")
def start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Server]]:
    """Start servers of the module's own (stopped at the end of the module)."""
    logs = tmp_path_factory.mktemp("own-server-logs")
    started: list[Server] = []

    def start(args: list[str], api_key: str | None = None) -> Server:
        started.append(Server(args, logs / f"{len(started)}.log", api_key))
        return started[-1].wait_ready()

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="package")
def text_server(servers: dict[str, Server]) -> Server:
    return servers["text"]


@pytest.fixture(scope="package")
def image_server(servers: dict[str, Server]) -> Server:
    return servers["image"]


@pytest.fixture(scope="package")
def browser() -> Iterator[object]:
    """One headless Chromium for the package's playground tests (omnistage/testing/browser.py);
    they skip, naming what is missing, where it or its driver is not installed."""
    from omnistage.testing.browser import chromium, missing

    lacking = missing()
    if lacking:
        pytest.skip(f"no headless browser: {', '.join(lacking)} not installed "
                    "(scripts/setup.sh --test installs them)")
    with chromium() as driver:
        yield driver


@pytest.fixture(scope="package")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the browser tests keep their screenshots: $OMNISTAGE_TEST_ARTIFACTS/playground,
    else a pytest temporary folder."""
    folder = os.environ.get("OMNISTAGE_TEST_ARTIFACTS")
    if folder is None:
        return tmp_path_factory.mktemp("playground-screenshots")
    path = Path(folder) / "playground"
    path.mkdir(parents=True, exist_ok=True)
    return path
