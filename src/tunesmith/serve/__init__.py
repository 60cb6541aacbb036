"""`tunesmith serve`: an OpenAI-compatible HTTP server for a model and any number of LoRA adapters over it.

One copy of the base weights is loaded (a base, a merged folder or a `tunesmith quantize` folder, on cuda, mps or
cpu); each --adapter is added to it as a PEFT named adapter, and a request's `model` field picks the base or an
adapter by name. `engine` generates (one worker thread, one batched forward per step for every running answer, a
bounded first-come, first-served queue), `api` speaks HTTP (FastAPI on uvicorn: pip install 'tunesmith[serve]').
"""

from __future__ import annotations

import contextlib
import gc
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from tunesmith.config import ServeConfig
from tunesmith.errors import TunesmithError, missing_extra


def require_extra() -> None:
    """fastapi and uvicorn, or the error that says how to install them."""
    for package in ("fastapi", "uvicorn"):
        try:
            __import__(package)
        except ImportError:
            raise missing_extra(package, "serve", "tunesmith serve") from None


def serve(cfg: ServeConfig) -> None:
    """Load the model and its adapters, then answer requests until Ctrl-C (or SIGTERM)."""
    require_extra()
    from tunesmith.serve.api import build_app
    from tunesmith.serve.engine import Engine

    sock = listen(cfg.host, cfg.port)  # a port in use fails now, not after the model loads
    served = load_served(cfg)
    engine = Engine(served.model, served.tokenizer, cfg.parallel, deterministic=cfg.deterministic)
    app = build_app(served, engine, cfg.api_key, cfg.max_tokens)
    engine.start()  # graphs captured and kernels warmed before the first request (the app's start finds it running)
    # What is loaded now lives as long as the process: frozen, out of the collector's sight, a full collection no
    # longer walks its half a million objects (0.2 s on the 2-core CPU with SmolLM2 loaded, while the engine's
    # thread and the event loop wait)
    gc.collect()
    gc.freeze()
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    names = ", ".join([served.base_name, *served.adapters])
    print(f"serving {names} at http://{shown}:{port}/v1 (OpenAI API; context {served.context_length} tokens"
          f"{'; bearer token required' if cfg.api_key else ''}); Ctrl-C stops", flush=True)
    _server(app, sock, log_level="info").run(sockets=[sock])


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one), IPv4 or IPv6 as the host is written."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise TunesmithError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port or "
                             "--host") from None
    sock.listen(128)
    return sock


def _server(app, sock: socket.socket, log_level: str):
    import uvicorn

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=3,
                            lifespan="on")
    return uvicorn.Server(config)


@contextlib.contextmanager
def running(app, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve `app` on a thread of this process while the block runs; yields the base URL (ending in /v1)."""
    sock = listen(host, port)
    server = _server(app, sock, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server thread ended before it started")
        thread.join(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join()


def _calibrated_codes(adapters: dict[str, str]) -> Path | None:
    """The calibrated base's codes (train --base-calibration) the adapters were trained on, or None for a base
    rounded to nearest. Adapters served together share one base, so they must share its codes too."""
    import hashlib

    from tunesmith.qlora import BASE_CODES

    files = {name: Path(path) / BASE_CODES for name, path in adapters.items()}
    present = {name: f for name, f in files.items() if f.is_file()}
    if not present:
        return None
    digests = {hashlib.sha256(f.read_bytes()).hexdigest() for f in present.values()}
    if len(present) < len(files) or len(digests) > 1:
        raise TunesmithError("--adapter: these adapters were trained on different bases (calibrated with "
                             f"--base-calibration: {', '.join(sorted(present))}; each run calibrates its own); serve "
                             "together only adapters trained on the same base")
    return next(iter(present.values()))


def load_served(cfg: ServeConfig, progress: bool = True):
    """The model (with every adapter loaded beside the others, over one copy of the base) and its names."""
    from tunesmith.device import resolve_device, resolve_precision, weight_dtype
    from tunesmith.lora import base_model_for, load_adapter, recorded_quantization
    from tunesmith.models import BUILTIN_MODELS, context_length, load_model
    from tunesmith.progress import status
    from tunesmith.serve.engine import Served

    adapters = dict(a.split("=", 1) for a in cfg.adapter)
    spec = base_model_for(cfg.model, next(iter(adapters.values()), None))
    for path in adapters.values():
        base_model_for(spec, path)  # each adapter must fit the one base: a mismatch names both
    schemes = {recorded_quantization(p) for p in adapters.values()} or {"none"}
    if len(schemes) > 1:
        raise TunesmithError(f"--adapter: these adapters were trained on the base held as {', '.join(sorted(schemes))}"
                             " (QLoRA --quantize-base); serve together only adapters trained the same way")
    device = resolve_device(cfg.device)
    dtype = weight_dtype(device, resolve_precision(device, cfg.precision))
    model, tokenizer = load_model(spec, device, dtype, cfg.trust_remote_code, quantize_base=schemes.pop())
    calibrated = _calibrated_codes(adapters)
    if calibrated is not None:
        from tunesmith.qlora import apply_base_codes

        apply_base_codes(model, calibrated)
    for name, path in adapters.items():
        model = load_adapter(model, path, base=spec, name=name)
    model.eval()
    base_name = cfg.served_model_name or (spec if spec in BUILTIN_MODELS or not Path(spec).expanduser().exists()
                                          else Path(spec).name.removesuffix(".gguf"))
    if base_name in adapters:
        raise TunesmithError(f"--adapter {base_name}: the base model is served under that name; name the adapter "
                             "otherwise (NAME=PATH) or pass --served-model-name")
    status(f"loaded {spec} on {device}" + (f" with adapters {', '.join(adapters)}" if adapters else ""), progress)
    return Served(model, tokenizer, base_name, spec, adapters, context_length(model, tokenizer))
