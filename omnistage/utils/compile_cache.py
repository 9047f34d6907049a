"""Where torch.compile keeps what it compiled, so that a restarted server does not pay the
compile again: inductor's FX graph and AOTAutograd caches and the Triton kernels it built live
under TORCHINDUCTOR_CACHE_DIR, which torch reads when it first compiles. Its default is a
folder under /tmp (gone with a reboot, and per user); a stage that compiles points it at
$OMNISTAGE_CACHE_DIR/inductor (default ~/.cache/omnistage/inductor) unless the user set it."""

from __future__ import annotations

import os
from pathlib import Path


def persistent_compile_cache() -> Path:
    """Point inductor's cache at the persistent folder (TORCHINDUCTOR_CACHE_DIR wins if set);
    returns the folder in use."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    base = os.environ.get("OMNISTAGE_CACHE_DIR") or Path.home() / ".cache" / "omnistage"
    path = Path(base) / "inductor"
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path
