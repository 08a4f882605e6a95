"""The entropy lens: the web page `entropic serve` serves at / (docs/lens.md).

The page and its assets are files of this package (`server/lens/`), read once when the app
is built and served from memory under a fixed list of paths, so no request names a file.
They are served without the API key (they hold no data): every API call the page makes
carries the key the user types into it. Each asset goes out with a Content-Security-Policy
that allows scripts, styles and connections from this origin only, so the page runs
nothing fetched from elsewhere, and model text shown as text can never become a script.
"""
from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from entropic.server.errors import ApiError

ASSET_PREFIX = "/lens/"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".txt": "text/plain; charset=utf-8",
          ".svg": "image/svg+xml"}

# 'self' only: no inline script, no eval, no remote script or style, no framing of the page.
# Styles set from script through element.style (uPlot, token colours) are not inline
# styles in CSP's sense and need no 'unsafe-inline'.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}


def load_assets() -> dict[str, tuple[bytes, str]]:
    """URL path -> (body, media type) of every servable file under server/lens/; the page
    itself, index.html, is also served at /."""
    root = resources.files("entropic.server") / "lens"
    assets: dict[str, tuple[bytes, str]] = {}

    def walk(node, rel: str) -> None:
        for child in node.iterdir():
            name = rel + child.name
            if child.is_dir():
                walk(child, name + "/")
                continue
            kind = _TYPES.get("." + child.name.rsplit(".", 1)[-1]) if "." in child.name else None
            if kind is not None:
                assets[ASSET_PREFIX + name] = (child.read_bytes(), kind)

    walk(root, "")
    index = assets.get(ASSET_PREFIX + "index.html")
    if index is None:
        raise RuntimeError("the entropy lens page (server/lens/index.html) is missing from "
                           "the package; reinstall it, or serve with --no-ui")
    assets["/"] = index
    return assets


def lens_router() -> APIRouter:
    """GET / and /lens/<asset>; anything else under /lens/ is the app's JSON 404."""
    assets = load_assets()
    router = APIRouter()

    def serve(path: str) -> Response:
        body, kind = assets[path]
        return Response(body, media_type=kind, headers=HEADERS)

    @router.get("/", include_in_schema=False)
    async def page() -> Response:
        return serve("/")

    @router.get(ASSET_PREFIX + "{name:path}", include_in_schema=False)
    async def asset(name: str) -> Response:
        path = ASSET_PREFIX + name
        if path not in assets:
            raise ApiError(404, f"no such file: {path}")
        return serve(path)

    return router
