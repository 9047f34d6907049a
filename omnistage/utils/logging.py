"""Logging set-up shared by the server and the stage processes, and a progress reporter that
suits both a terminal and a log file.

    configure_logging(level)     timestamps on every line; transformers' repeated warnings once
    quiet_known_noise()          drops warnings of transformers' that are wrong for our models
    uvicorn_log_config(level)    uvicorn's own lines (access included) in the same format
    Progress(total, desc)        a tqdm bar on a terminal, else an INFO line every 10 % or 5 s
"""

from __future__ import annotations

import copy
import logging
import re
import sys
import time
from typing import Callable

from tqdm import tqdm

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# libraries whose warnings repeat (per request, per stage, per loaded component)
NOISY_LIBRARIES = ("transformers", "diffusers")


class OnceFilter(logging.Filter):
    """Lets each distinct message of the named loggers through once: transformers repeats the
    same warning for every request or component that triggers it. Other loggers pass as they
    are. The set of messages seen is bounded, so a message that varies (a count, an id) cannot
    grow it without end: past the bound, everything passes again."""

    def __init__(self, prefixes: tuple[str, ...] = NOISY_LIBRARIES, max_seen: int = 4096
                 ) -> None:
        super().__init__()
        self.prefixes, self.max_seen = prefixes, max_seen
        self.seen: set[tuple[str, int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self.prefixes):
            return True
        key = (record.name, record.levelno, record.getMessage())
        if key in self.seen:
            return False
        if len(self.seen) < self.max_seen:
            self.seen.add(key)
        return True


# transformers (5.x) validates `rope_parameters` against the plain rope types and calls the
# multimodal rotary keys of Qwen-Omni / Qwen-VL configs unrecognized: once per config loaded,
# in every process (4 lines at a Qwen3-Omni server's start, 12 in an offline script)
MROPE_KEYS = frozenset({"mrope_section", "interleaved", "mrope_interleaved"})
_UNRECOGNIZED_ROPE = re.compile(r"Unrecognized keys in `rope_parameters` for 'rope_type'='\w+': "
                                r"\{(.*)\}")


class KnownNoiseFilter(logging.Filter):
    """Drops transformers' warning that the multimodal rotary keys (MROPE_KEYS) are
    unrecognized: they are read by our rotary layers (layers/mrope.py). Any other key in the
    same warning lets it through."""

    def filter(self, record: logging.LogRecord) -> bool:
        match = _UNRECOGNIZED_ROPE.match(record.getMessage())
        if match is None:
            return True
        keys = {k.strip().strip("'\"") for k in match.group(1).split(",")}
        return not keys <= MROPE_KEYS


def quiet_known_noise() -> None:
    """Put KnownNoiseFilter on the logger that emits it (whether or not transformers is
    imported yet: loggers are looked up by name). Idempotent."""
    target = logging.getLogger("transformers.modeling_rope_utils")
    if not any(isinstance(f, KnownNoiseFilter) for f in target.filters):
        target.addFilter(KnownNoiseFilter())


def configure_logging(level: str | int = "INFO", fmt: str = LOG_FORMAT) -> OnceFilter:
    """Root logging to stderr with timestamps, and one OnceFilter on every handler the noisy
    libraries' records reach (transformers keeps its own handler and does not propagate)."""
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, format=fmt)
    quiet_known_noise()
    once = OnceFilter()
    import transformers.utils.logging as hf_logging

    hf_logging.get_logger()          # makes transformers set up its own handler now
    for name in ("", *NOISY_LIBRARIES):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, OnceFilter) for f in handler.filters):
                handler.addFilter(once)
    return once


def uvicorn_log_config(level: str = "info") -> dict:
    """uvicorn's logging config (uvicorn.config.LOGGING_CONFIG) with our line format: a
    timestamp and the logger's name on its start-up lines and on every access line."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"]["default"].update(fmt=LOG_FORMAT, use_colors=False)
    config["formatters"]["access"].update(
        fmt='%(asctime)s %(levelname)s %(name)s: %(client_addr)s - "%(request_line)s" '
            "%(status_code)s", use_colors=False)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        config["loggers"][name]["level"] = level.upper()
    return config


class Progress:
    """Progress of a long count (bytes of weights read): a tqdm bar when stderr is a terminal;
    otherwise (a log file, a container) INFO lines on `logger`, one whenever another tenth of
    the total is done (at most one a `min_gap_s`) or `every_s` passed since the last line, and
    one at the end: a count done in an instant logs that one line only."""

    def __init__(self, total: int, desc: str, logger: logging.Logger, unit: str = "B",
                 every_s: float = 5.0, is_terminal: bool | None = None,
                 clock: Callable[[], float] = time.monotonic, min_gap_s: float = 1.0) -> None:
        self.total, self.desc, self.logger, self.unit = total, desc, logger, unit
        self.every_s, self.clock, self.min_gap_s = every_s, clock, min_gap_s
        self.done = 0
        self.start = self.last_time = clock()
        self.next_tenth = 1
        if is_terminal is None:
            is_terminal = sys.stderr.isatty()
        self.bar = (tqdm(total=total, desc=desc, unit=unit, unit_scale=True)
                    if is_terminal else None)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = self.clock()
        tenth = 10 * self.done // self.total if self.total > 0 else 10
        since = now - self.last_time
        if (tenth >= self.next_tenth and self.done < self.total and since >= self.min_gap_s) \
                or since >= self.every_s:
            self.next_tenth = tenth + 1
            self.last_time = now
            self.logger.info("%s: %s / %s (%d%%)", self.desc, self._size(self.done),
                             self._size(self.total), 100 * self.done // max(self.total, 1))

    def close(self, failed: bool = False) -> None:
        """End the bar, or log the total and the rate (not for a count that `failed`)."""
        if self.bar is not None:
            self.bar.close()
            return
        if failed:
            return
        seconds = self.clock() - self.start
        rate = f", {self._size(self.done / seconds)}/s" if seconds > 0 else ""
        self.logger.info("%s: %s in %.1f s%s", self.desc, self._size(self.done), seconds, rate)

    def _size(self, n: float) -> str:
        return tqdm.format_sizeof(n, self.unit) if self.unit == "B" else f"{n:.3g}"

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(failed=exc_type is not None)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a line is written (a test's capture, a
    redirection made after the first line)."""

    @property   # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def progress_logger() -> logging.Logger:
    """A logger whose INFO lines go to stderr as they are, whatever the root logger's level:
    the plain progress lines of an offline run whose stderr is not a terminal (a pipe, a
    file), where a tqdm bar would write carriage-return frames."""
    logger = logging.getLogger("omnistage.progress")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
