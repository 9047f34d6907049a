"""Checks `omnistage serve` makes before any model loads, so that a wrong argument costs a
second and one line on stderr, not a minute of loading and a traceback from a stage process.

    model path     exists, is a checkpoint folder, holds its weights
    port           bound here, now (the socket is handed to uvicorn)
    TLS files      loaded into an SSL context
    chat template  read (a file, or the template text itself)
    API key        from --api-key, --api-key-file or $OMNISTAGE_API_KEY (one of them)
"""

from __future__ import annotations

import json
import os
import socket
import ssl
from pathlib import Path


def is_path_like(name: str) -> bool:
    """Whether MODEL was written as a path ('./x', '../x', '/x', '~/x'), never a Hub id."""
    return name.startswith((".", "/", "~")) or name == "."


def resolve_model(model: str) -> Path:
    """The checkpoint folder of MODEL with its weights in place; FileNotFoundError otherwise.
    A path that does not exist is named as such: nothing suggests downloading a local path."""
    if is_path_like(model):
        path = Path(model).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model {model!r}: no such file or folder")
        if not path.is_dir():
            raise FileNotFoundError(f"model {model!r}: a file, not a checkpoint folder")
    from omnistage.models.loader import resolve_model_path   # imports torch: not for --help

    path = resolve_model_path(model)
    check_weights(model, path)
    return path


def check_weights(model: str, path: Path) -> None:
    """A transformers folder needs safetensors files at its top (model.safetensors; BAGEL's
    ema.safetensors and ae.safetensors) or an index whose shards all exist; a diffusers folder (model_index.json) needs safetensors files in its component folders."""
    if (path / "cosyvoice3.yaml").is_file():   # CosyVoice3: *.pt, checked when its stages load
        return
    if (path / "model_index.json").is_file():
        if not any(path.glob("*/*.safetensors")):
            raise FileNotFoundError(f"model {model!r}: folder {path} has model_index.json but "
                                    "no weights (no */*.safetensors)")
        return
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing or not shards:
            raise FileNotFoundError(f"model {model!r}: {index.name} lists "
                                    f"{missing[0] if missing else 'no shards'}, which "
                                    f"{'is missing' if missing else 'leaves no weights'}")
        return
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"model {model!r}: folder {path} has config.json but no weights "
                                "(no *.safetensors, no model.safetensors.index.json)")


def resolve_tokenizer(name: str) -> str:
    """--tokenizer as a local folder: a folder as given, or a Hub id in the local cache."""
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path)
    if is_path_like(name):
        raise FileNotFoundError(f"--tokenizer {name!r}: no such folder")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(name, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError):
        raise FileNotFoundError(f"--tokenizer {name!r}: neither a local folder nor in the local "
                                f"Hugging Face cache (fetch it first: `hf download {name}`)"
                                ) from None


def read_chat_template(value: str) -> str:
    """--chat-template: a Jinja file, or the template text itself (as vLLM takes it)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise FileNotFoundError(f"--chat-template {value!r}: no such file (give a Jinja file or "
                            "the template text)")


def bind_port(host: str, port: int) -> socket.socket:
    """Bind HOST:PORT now, before the model loads; a port in use is one clear error. The
    socket goes to uvicorn (`Server.run(sockets=...)`), so nothing can take the port between."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: cannot resolve ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: no TIME_WAIT wait
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror}); is another "
                      "server running there? pick another with --port") from None
    sock.set_inheritable(True)
    return sock


def check_ssl(certfile: str | None, keyfile: str | None) -> None:
    """Load the TLS certificate and key now, as uvicorn will after the model has loaded."""
    if keyfile and not certfile:
        raise ValueError("--ssl-keyfile needs --ssl-certfile")
    if not certfile:
        return
    for flag, name in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if name and not Path(name).is_file():
            raise FileNotFoundError(f"{flag} {name}: no such file")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"--ssl-certfile {certfile}: cannot load the certificate and key "
                         f"({e})") from None


def read_api_key(flag_key: str | None, key_file: str | None, env_name: str) -> str | None:
    """The API key from --api-key, --api-key-file (its first line) or the environment
    variable `env_name`; a file or the environment keeps it out of `ps`. Two sources, or an
    empty key, are refused: which one wins would be a guess."""
    env_key = os.environ.get(env_name) or None
    given = [name for name, v in (("--api-key", flag_key), ("--api-key-file", key_file),
                                  (f"${env_name}", env_key)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"the API key is given twice ({' and '.join(given)}): give one")
    if key_file is not None:
        path = Path(key_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--api-key-file {key_file}: no such file")
        lines = path.read_text().splitlines()
        flag_key = lines[0].strip() if lines else ""
    key = flag_key if flag_key is not None else env_key
    if key is not None and not key.strip():
        raise ValueError(f"{given[0]}: the API key is empty")
    return key
