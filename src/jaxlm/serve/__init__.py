"""`jaxlm serve`: an OpenAI-compatible HTTP server over a continuous-batching engine (docs/serve.md).

engine.py owns the device (decode slots sharing one KV cache, cache.py) and serves requests.py's sequences and
scores with programs.py's device programs, chunk.py prefills prompts into their slots a chunk at a time, pages.py
and prefix_cache.py share prompts' keys and values, replicas.py runs several engines side by side as one
(serve.replicas), schemas.py validates requests, app.py is the HTTP API (routes; guard.py in front, choices.py
streaming the answers, chat_page.py the chat page at /), protocol.py bounds connections; this module builds them from
a model folder and settings, and runs the server (uvicorn).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from jaxlm import config as config_lib, runtime, sharding
from jaxlm.model import paged
from jaxlm.config import Config, ConfigError
from jaxlm.data import tokenizer as tokenizer_lib


def settings_config(overrides: dict) -> Config:
    """A Config from decode.*, serve.* and mesh.* settings (decode keys may leave out their prefix)."""
    full = {}
    for k, v in overrides.items():
        section = k.split(".", 1)[0] if "." in k else None
        if section not in ("decode", "serve", "mesh"):
            if section is None:
                k = f"decode.{k}"
            else:
                raise ConfigError(f"{k}: `jaxlm serve` takes decode.*, serve.* and mesh.* settings")
        full[k] = v
    cfg = config_lib.apply_overrides(Config(), full)
    config_lib.validate_decode(cfg.decode)
    config_lib.validate_serve(cfg.serve)
    if cfg.decode.draft and not cfg.serve.page_size:
        raise ConfigError("decode.draft (speculative decoding) in the server needs the paged KV cache; leave "
                          "serve.page_size > 0")
    return cfg


def chat_template(model, template_file: str) -> Callable[[list[dict]], str] | None:
    """messages -> prompt text through the model's tokenizer: with serve.chat_template's Jinja file, else the
    tokenizer's own template (a converted model's tokenizer_config.json or chat_template.jinja); None when there
    is none."""
    tok = model.tokenizer()
    template = Path(template_file).read_text() if template_file else tok.chat_template
    if not template:
        return None
    strings = tok.token_strings()
    return lambda messages: tokenizer_lib.render_chat(template, messages, True, strings)


def build(src: str | Path, cfg: Config, log: Callable[[str], None] = print):
    """The engine (started, compiled) and the app's state for the model at `src`."""
    from jaxlm.infer import api
    from jaxlm.serve.engine import Engine
    from jaxlm.serve.replicas import Replicas
    from jaxlm.serve.served import Served
    from jaxlm.infer.speculative import Draft

    d, sc = cfg.decode, cfg.serve
    mesh_cfg = cfg.mesh if cfg.mesh != Config().mesh else None
    model = api.load(src, mesh_cfg, d.quantize_weights)
    m = model.config.model
    sc = dataclasses.replace(sc, page_size=paged.page_size(sc.page_size, paged.pool_format(runtime.platform(model.mesh))))
    length = d.cache_length or m.block_size
    if m.position == "learned" and length > m.block_size:
        raise ConfigError(f"decode.cache_length={length} is past this model's learned positions "
                          f"(model.block_size={m.block_size})")
    tok = model.tokenizer()
    stop = config_lib.stop_token_ids(d) + (tok.eos_ids if d.stop_at_eos else ())
    if sc.replicas > 1 and model.mesh is not None and model.mesh.size > 1:
        raise ConfigError(f"serve.replicas={sc.replicas} runs engines side by side on one device; with a mesh of "
                          f"{model.mesh.size} devices keep serve.replicas=1 (one engine sharded over them)")
    R = sc.replicas
    pages = cache_pages(m, sc, length, d.quantize_kv_cache) // R if sc.page_size else None
    name = sc.model_name or Path(src).resolve().name
    names, params = with_adapters(model, config_lib.serve_adapters(sc), name)
    draft = None
    if d.draft == "mtp":  # the model's own first multi-token prediction module
        draft = Draft(None, None, config_lib.draft_tokens(d, mtp=True))
    elif d.draft:
        drafted = api.load(d.draft, mesh_cfg)
        draft = Draft(drafted.params, drafted.config.model, config_lib.draft_tokens(d, mtp=False))
    each = dataclasses.replace(sc, max_slots=sc.max_slots // R, max_queue=Replicas.split(sc.max_queue, R))
    engines = [Engine(params, m, each, length, quantize_kv_cache=d.quantize_kv_cache, cache_pages=pages, draft=draft,
                      mesh=model.mesh, rules=sharding.rules_from_config(cfg.mesh)) for _ in range(R)]
    engine = engines[0] if R == 1 else Replicas(engines)
    log(f"jaxlm serve: compiling the prefill and decode programs of {name} (a minute or two on a CPU the first time; "
        f"compile.cache_dir keeps them for the next start)")
    started = time.perf_counter()
    engine.warm_up()
    compiled_s = time.perf_counter() - started
    engine.start()
    api_key = api_key_of(sc)
    served = Served(engine, tok.encode, lambda text: api.encode_prompt(tok, text), tok.encode_rendered,
                    tok.decode, name, m.vocab_size, d, stop,
                    chat_template(model, sc.chat_template), api_key, tok.bos_id, tok.eos_id,
                    allowed_hosts(sc), frozenset(o.strip() for o in sc.allowed_origins.split(",") if o.strip()),
                    int(sc.max_body_mb * 2**20), length * (longest_token(tok) + 1), names,
                    sc.max_tokenize_chars, *image_serving(model, tok, sc, draft), ui=sc.ui)
    replicas = f" in {R} replicas" if R > 1 else ""
    if sc.page_size:
        per_page = paged.bytes_per_token(m, d.quantize_kv_cache, packed=packed(sc)) * sc.page_size
        cache = (f"KV cache of {pages * R} pages of {sc.page_size} positions ({pages * R * per_page / 2**30:.2f} "
                 f"GiB, {pages * R * sc.page_size} positions)")
    else:
        cache = "slot KV cache"
    log(f"jaxlm serve: {served.name} | {cache} | {sc.max_slots} sequences{replicas} x {length} positions | up to "
        f"{sc.decode_steps} decode steps per call | prefill chunks of "
        f"{sc.prefill_chunk} | prefix cache {sc.prefix_cache or 'off'} | "
        f"{'LoRA adapters ' + ','.join(names) + ' | ' if names else ''}"
        f"{f'draft {d.draft} proposing {draft.k} tokens | ' if draft else ''}"
        f"{'API key required' if api_key else 'no API key'} | compiled in {compiled_s:.0f} s")
    if not sc.uds and (warning := exposure_warning(sc.host, api_key)) is not None:
        log(warning)
    return served


def image_serving(model, tok, sc, draft) -> tuple:
    """(what chat requests' images need, or None; why images are refused when None) for `model`."""
    from jaxlm.data import image_kinds
    from jaxlm.serve.images import ImageServing
    from jaxlm.store import weights

    m = model.config.model
    if m.vision is None:
        return None, "this model has no vision tower"
    if draft is not None:
        return None, "this server drafts tokens (decode.draft), which it does not do with images"
    if not sc.max_images_per_request:
        return None, "this server takes no images (serve.max_images_per_request=0)"
    kind = image_kinds.of(m.vision)
    processor = kind.processor(weights.tokenizer_source(model.path, model.config), m.vision)
    return ImageServing(m, kind, processor, kind.marker(tok, m.vision),
                        lambda text, prepared: kind.expand(text, tok, m.vision, prepared), sc.max_images_per_request,
                        sc.max_image_pixels, sc.allow_image_urls, int(sc.max_body_mb * 2**20)), ""


def with_adapters(model, entries: list[tuple[str, str]], name: str) -> tuple[tuple[str, ...], dict]:
    """The names of serve.adapters' adapters and the weights that serve them over the model's
    (lora.serving_weights; the model's own weights when there are none)."""
    if not entries:
        return (), model.params
    import jax

    from jaxlm.store import adapters as adapters_lib
    from jaxlm.model import lora

    if name in (n for n, _ in entries):
        raise ConfigError(f"serve.adapters names {name!r}, the base model's own name; give the adapter another")
    leaf = jax.tree.leaves(model.params)[0]
    one = (jax.sharding.NamedSharding(model.mesh, jax.sharding.PartitionSpec()) if model.mesh is not None
           else leaf.sharding)
    loaded = [adapters_lib.for_serving(path, model.config, one) for _, path in entries]
    return tuple(n for n, _ in entries), lora.serving_weights(model.params, loaded)


CPU_CACHE_GIB = 4.0  # the paged cache's memory on a CPU by default (vLLM's CPU backend takes 4 GiB too)
ACCELERATOR_CACHE_FRACTION = 0.8  # of an accelerator's free memory, by default


def packed(sc) -> bool | None:
    """Whether the pool of this process's default devices packs keys and values (our kernel on a TPU: True with
    serve.attention_kernel_options packed_kv=1, None by default, where the model's pool can be): its bytes a token
    are then the packed entry's (paged.bytes_per_token)."""
    return paged.packs(paged.pool_format(runtime.platform(), sc.attention_kernel, sc.attention_kernel_options))


def cache_pages(m, sc, length: int, quantize: bool) -> int:
    """Pages of the paged KV cache: serve.cache_gib of them, or by default as many as give each of
    serve.max_slots the whole context (the slot cache's memory), at most CPU_CACHE_GIB on a CPU and
    ACCELERATOR_CACHE_FRACTION of the free memory of an accelerator."""
    import jax

    sc = dataclasses.replace(sc, page_size=paged.page_size(sc.page_size))  # -1: the default devices' page
    per_page = paged.bytes_per_token(m, quantize, packed=packed(sc)) * sc.page_size
    if sc.cache_gib:
        return max(1, int(sc.cache_gib * 2**30 // per_page))
    pages = sc.max_slots * -(-length // sc.page_size)
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        budget = ACCELERATOR_CACHE_FRACTION * (stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    else:
        budget = CPU_CACHE_GIB * 2**30
    return max(1, min(pages, int(budget // per_page)))


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The line `jaxlm serve` prints when it listens beyond loopback without an API key."""
    if api_key or is_loopback(host):
        return None
    return (f"jaxlm serve: WARNING: serve.host={host} is reachable beyond this machine and no API key is set: "
            "anyone who reaches the port can use the model. Set serve.api_key_file (or JAXLM_API_KEY), and put TLS "
            "in front (docs/serve.md, Security)")


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def allowed_hosts(sc) -> frozenset | None:
    """The Host header names answered: serve.allowed_hosts ('*' = any), else the loopback names on a loopback
    address and any on another (the server cannot know every name that reaches it there) or on a unix socket
    (serve.uds: no browser reaches it but through a proxy, which sends the names it serves)."""
    from jaxlm.serve.served import LOOPBACK_HOSTS

    names = frozenset(h.strip().lower().strip("[]") for h in sc.allowed_hosts.split(",") if h.strip())
    if "*" in names:
        return None
    if names:
        return names
    return LOOPBACK_HOSTS if is_loopback(sc.host) and not sc.uds else None


def api_key_of(sc) -> str | None:
    """serve.api_key, else the first line of serve.api_key_file, else $JAXLM_API_KEY; None when none is set."""
    if sc.api_key:
        return sc.api_key
    if sc.api_key_file:
        text = Path(sc.api_key_file).read_text().strip()
        key = text.splitlines()[0].strip() if text else ""
        if not key:
            raise ConfigError(f"serve.api_key_file={sc.api_key_file} is empty; its first line must be the key")
        return key
    return os.environ.get("JAXLM_API_KEY") or None


def longest_token(tok) -> int:
    """The most characters one token's text holds, so that a text longer than the context's tokens times this
    cannot fit in it (app._encode refuses it before tokenizing). One for char and byte vocabularies."""
    longest = 1
    for i in range(tok.vocab_size):
        try:
            longest = max(longest, len(tok.decode([i])))
        except Exception:  # noqa: BLE001 - an id a tokenizer cannot decode alone holds no text to count
            continue
    return longest


def address(sc) -> str:
    """Where `jaxlm serve` listens, as its start-up line names it."""
    if sc.uds:
        return f"unix:{sc.uds} (http://localhost/v1 through the socket)"
    return f"http://{sc.host}:{sc.port}/v1"


def claim_uds(path: str) -> None:
    """Stop in one line when a server listens on the unix socket at serve.uds already. A socket file nobody
    listens on (left by a server that was killed) is replaced when the new server binds (asyncio and uvloop
    remove it first, keeping its permissions, as uvicorn and gunicorn do); config.validate_uds refused any file
    that is not a socket."""
    import socket

    if not Path(path).is_socket():
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:  # refused: stale
            return
    raise ConfigError(f"serve.uds={path}: a server is listening on this socket already; stop it or choose another "
                      "path")


class Server:
    """uvicorn serving an app in a background thread (tests, benchmarks), on host:port or, with `uds`, a unix
    socket, its connections under `limits` (serve.* settings: the defaults when None); `stop()` shuts it down. It
    leaves the process's logging as it is (log_config=None): uvicorn's own configuration replaces every handler
    there is, closing their streams (one of them, absl's, held a stream pytest had since replaced)."""

    def __init__(self, served, host: str = "127.0.0.1", port: int = 0, uds: str = "", limits=None):
        import uvicorn

        from jaxlm.config import ServeConfig
        from jaxlm.serve import protocol
        from jaxlm.serve.app import create_app

        if uds:
            claim_uds(uds)
        self.served, self.uds = served, uds
        self.server = uvicorn.Server(uvicorn.Config(create_app(served), host=host, port=port, uds=uds or None,
                                                    log_level="warning", access_log=False,
                                                    timeout_graceful_shutdown=5, log_config=None,
                                                    http=protocol.protocol(limits or ServeConfig(),
                                                                           served.count_error)))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> "Server":
        import time

        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start (is the port taken?)")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self, engine: bool = True) -> None:
        """Shut the HTTP server down (its socket file too), and its engine unless `engine` is False (another
        server shares it)."""
        self.server.should_exit = True
        self.thread.join(timeout=30)
        if self.uds and Path(self.uds).is_socket():
            os.remove(self.uds)
        if engine:
            self.served.engine.stop()


def run(src: str, overrides: dict) -> int:
    """`jaxlm serve SRC [key=value ...]`: serve until interrupted."""
    import uvicorn

    from jaxlm.serve import chat_page, protocol
    from jaxlm.serve.app import create_app

    cfg = settings_config(overrides)
    sc = cfg.serve
    if sc.uds:
        claim_uds(sc.uds)  # before the model loads and compiles
    served = build(src, cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    # What exists now (weights, compiled programs, modules) lives as long as the server: frozen out of the garbage
    # collector's sight, so that its full collections scan only what requests make (they stopped every stream for
    # up to 0.2 s on a 2-core CPU before; docs/serve.md, Security)
    gc.collect()
    gc.freeze()
    print(f"listening on {address(sc)}", file=sys.stderr, flush=True)
    if (page := chat_page.address_line(sc)) is not None:
        print(page, file=sys.stderr, flush=True)
    # uvicorn shuts down gracefully on SIGTERM, then raises it again: here as SystemExit, so that the engine stops
    # and uvicorn.run removes serve.uds's socket file (the signal's default action would end the process first).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        uvicorn.run(create_app(served), host=sc.host, port=sc.port, uds=sc.uds or None, log_level="warning",
                    access_log=False, http=protocol.protocol(sc, served.count_error))
    finally:
        served.engine.stop()
    return 0
