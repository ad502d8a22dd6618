"""The chat page `jaxlm serve` answers at / (serve.ui): static/chat.html with its script and style sheet, static files
with no build step that work offline, talking to the server's own /v1/chat/completions (docs/serve.md, "Chat page").
The page and its two files are served without the API key (they hold nothing of the model); every API call the page
makes needs the key as any client's does. Its answers carry a Content-Security-Policy that runs this server's script
alone (no inline script, nothing from elsewhere) and lets no other site frame the page; guard.py answers the page's
own API calls (same-origin requests) when the name it was opened by is one the server answers to.
"""

from __future__ import annotations

from importlib import resources

FILES = {"/": ("chat.html", "text/html; charset=utf-8"), "/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
         "/chat.css": ("chat.css", "text/css; charset=utf-8")}
PATHS = frozenset(FILES)
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_routes(app) -> None:
    """GET (and HEAD) of the page and its files, read once from the package."""
    from fastapi.responses import Response

    folder = resources.files("jaxlm.serve") / "static"

    def answer(body: bytes, media_type: str):
        async def page():
            return Response(body, media_type=media_type, headers=HEADERS)

        return page

    for path, (name, media_type) in FILES.items():
        app.add_api_route(path, answer((folder / name).read_bytes(), media_type), methods=["GET", "HEAD"],
                          include_in_schema=False)


def address_line(sc) -> str | None:
    """What `jaxlm serve` prints about its page: where to open it, or, on a unix socket (which browsers cannot
    reach), how to forward a TCP port to the socket; None when serve.ui is off."""
    if not sc.ui:
        return None
    if not sc.uds:
        host = "127.0.0.1" if sc.host in ("0.0.0.0", "::", "") else sc.host
        return f"chat page: http://{f'[{host}]' if ':' in host else host}:{sc.port}/"
    return (f"chat page: a browser needs TCP: forward a port to the socket, `socat TCP-LISTEN:{sc.port},"
            f"bind=127.0.0.1,reuseaddr,fork UNIX-CONNECT:{sc.uds}` here (or `ssh -L {sc.port}:{sc.uds} HOST` from "
            f"another machine), then open http://127.0.0.1:{sc.port}/")
