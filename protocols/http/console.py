"""The web console under ``/console`` (docs/admin.md): three static files, plain
HTML, CSS and JavaScript with no build step, that call the admin API from the
browser. Serving them needs no credentials (they hold none); every call they make is
checked by the admin API itself."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse, RedirectResponse

__all__ = ["console_router"]

_DIR = Path(__file__).resolve().parent / "console_files"
_FILES = {
    "index.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}


def console_router() -> APIRouter:
    router = APIRouter(tags=["console"])

    @router.get("/console", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/console/")

    @router.get("/console/", summary="The web console", include_in_schema=True)
    async def index() -> FileResponse:
        return FileResponse(_DIR / "index.html", media_type=_FILES["index.html"])

    @router.get("/console/{name}", include_in_schema=False)
    async def asset(name: str) -> FileResponse:
        if name not in _FILES:  # only the listed files: no path reaches beyond them
            raise HTTPException(404, "no such console file")
        return FileResponse(_DIR / name, media_type=_FILES[name])

    return router
