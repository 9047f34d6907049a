"""Every code block of README.md and of the pages under docs/ runs as written, so the examples
cannot rot: Python blocks as script files in a fresh interpreter (which also proves a script
needs no `__main__` guard), shell blocks in bash, YAML graphs through the strict parser and the
engine's graph checks, JSON through a JSON parser. Models the pages name are replaced by tiny
random checkpoints built here (the digits demo needs nothing). A block that cannot run on a CPU
says so, with its reason, in an HTML comment on the line before it:

    <!-- readme-test: skip (needs a GPU) -->      not run
    <!-- readme-test: parse (why) -->             YAML: parsed and checked, not served
    <!-- readme-test: with-demo-server -->        run while `omnistage serve` (the demo) is up
    <!-- readme-test: with-omni-server -->        run while `omnistage serve` serves the tiny
                                                  Qwen3-Omni (named as the block names it)

Links in those pages resolve inside the repository, anchors included, and the README stays a
front page (at most README_MAX_LINES lines; the rest lives in docs/).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from omnistage.testing.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# the README and every page under docs/ (generated ones too: docs/reliability.md)
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 250
CLI = f"{sys.executable} -m omnistage.entrypoints.cli.main"
RUN_TIMEOUT_S = 180
MARKER = re.compile(r"<!-- readme-test: ([\w-]+)(?: \((.+)\))? -->")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
# model names in the README -> the fixture holding a tiny checkpoint of that architecture
MODELS = {"Qwen/Qwen3-0.6B": "tiny_qwen3", "/models/Qwen3-0.6B": "tiny_qwen3",
          "/models/Qwen3-Omni-30B-A3B-Instruct": "tiny_omni"}
# Qwen3's ids for "Hello, world" -> ids inside the tiny tokenizer's vocabulary
TOKEN_IDS = {"[9707, 11, 1879]": "[9, 11, 18]"}


@dataclass(frozen=True)
class Block:
    page: str                 # the page's path in the repository, e.g. docs/api/chat.md
    lang: str
    code: str
    line: int                 # of the opening fence
    marker: str | None        # skip / parse / with-demo-server, or None
    reason: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:line{self.line}-{self.lang}"


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    blocks = []
    for fence in FENCE.finditer(text):
        before = text[:fence.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.fullmatch(before.strip())
        blocks.append(Block(page, fence.group(1), fence.group(2),
                            text.count("\n", 0, fence.start()) + 1,
                            marker.group(1) if marker else None,
                            marker.group(2) if marker else None))
    return blocks


def _page_name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# ```text fences (diagrams, folder trees) are prose, not code; an unlabelled fence fails
BLOCKS = [b for path in PAGES for b in readme_blocks(path.read_text(), _page_name(path))
          if b.lang != "text"]


def _substitute(code: str, request: pytest.FixtureRequest) -> str:
    for name, fixture in MODELS.items():
        if name in code:
            code = code.replace(name, str(request.getfixturevalue(fixture)))
    for ids, tiny in TOKEN_IDS.items():
        code = code.replace(ids, tiny)
    return code


def _env() -> dict[str, str]:
    """This checkout's omnistage first, whatever is installed in the environment."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _run(args: list[str], cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, input=stdin, capture_output=True, text=True, cwd=cwd,
                          env=_env(), timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n" \
                                 f"{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def tiny_omni(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny_omni"))


def _serve(argv: list[str], log: Path) -> Iterator[str]:
    """`omnistage serve ARGV` on a free port until the generator is closed; its base URL."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([*CLI.split(), "serve", *argv, "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=_env())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"the server exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no /health:\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`omnistage serve` with no model (the digits demo) on a free port; its base URL."""
    yield from _serve([], tmp_path_factory.mktemp("serve") / "serve.log")


@pytest.fixture(scope="module")
def omni_server(tiny_omni: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`omnistage serve` of the tiny Qwen3-Omni (served under its path, the name the blocks
    use once substituted); its base URL."""
    yield from _serve([str(tiny_omni), "--device", "cpu"],
                      tmp_path_factory.mktemp("serve") / "serve.log")


def _check_graph(code: str) -> None:
    """Parsed strictly and checked as the engine checks it, with real (registered, not test
    toy) components."""
    from omnistage.configs.graph import validate_graph
    from omnistage.configs.parse import load_graph_yaml
    from omnistage import registry
    from omnistage.stages import adapters

    graph = load_graph_yaml(code)
    validate_graph(graph, adapters=adapters.registered())
    targets = {(c.kind, c.name): c.target for f in registry.families().values()
               for c in f.components}
    for stage in graph.stages:
        if stage.component is None:
            continue
        name = stage.component.partition(".")[0]
        target = targets.get((stage.kind, name))
        assert target is not None, f"stage {stage.name}: component {stage.component} unknown"
        assert not target.startswith("omnistage.testing"), \
            f"stage {stage.name}: {stage.component} is a test toy"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if block.marker == "skip":
        assert block.reason, f"{block.page} line {block.line}: a skipped block says why"
        pytest.skip(block.reason)
    code = _substitute(block.code, request)
    servers = {"with-demo-server": "demo_server", "with-omni-server": "omni_server"}
    if block.marker in servers:
        code = code.replace("http://127.0.0.1:8000", request.getfixturevalue(servers[block.marker]))
    if block.lang == "python":
        script = tmp_path / "snippet.py"
        script.write_text(code)
        _run([sys.executable, str(script)], tmp_path)
    elif block.lang == "bash":
        code = re.sub(r"^(\.venv/bin/)?omnistage ", f"{CLI} ", code, flags=re.M)
        _run(["bash", "-eu", "-c", code], tmp_path)
    elif block.lang == "yaml":
        assert block.marker in (None, "parse"), block.marker
        _check_graph(code)
    elif block.lang == "json":   # the pages' only JSON: OpenAI's error body
        assert set(json.loads(code)["error"]) == {"message", "type", "param", "code"}
    else:
        pytest.fail(f"{block.page} line {block.line}: no way to run a "
                    f"{block.lang or 'plain'} block (mark it skip with a reason)")


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated heading numbered (-1, -2, ...)."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen.setdefault(f"{slug}-{count}", 1)
    return set(seen)


@pytest.mark.parametrize("page", PAGES, ids=_page_name)
def test_readme_links_stay_in_the_repository(page: Path) -> None:
    """Links resolve inside the repository, to a heading that exists where they name one (the
    README ships alone, e.g. on PyPI's page, and must not point at files of a larger checkout;
    a page that moves takes its anchors with it)."""
    text = page.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", text)):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        assert path.is_relative_to(ROOT) and path.exists(), f"{_page_name(page)} links to {target}"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path.read_text()), \
                f"{_page_name(page)} links to {target}: no such heading in {_page_name(path)}"
    if page == README:
        assert "../" not in text, "README refers to something outside the repository"


def test_readme_stays_a_front_page() -> None:
    """The README is what a newcomer reads first: what it is, the two setup commands, an
    example each for Python and a client, the models, where to go next; the rest is in docs/."""
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move sections to docs/"
    text = README.read_text()
    for command in ("scripts/setup.sh && .venv/bin/omnistage serve",
                    "scripts/setup.sh --test && .venv/bin/python -m pytest"):
        assert command in text, f"README lost the setup command {command!r} (.ci/run uses it)"
