"""The tokenizer of a checkpoint folder, or None when it ships none."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def load_tokenizer(path: Path | None) -> PreTrainedTokenizerBase | None:
    if path is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("no tokenizer in %s (%s): text in and out disabled", path, exc)
        return None
