"""Finished images kept on this server, so that a page can show them again (its history after a reload, its
edit thread) and a link can open one: PNG files under random ids, bounded in count and bytes (the oldest
go first). In a temporary folder that goes with the server, or in a folder given (`--results-dir`) that
keeps them for the next start. `results_router` serves them read-only: a result's page (its image,
settings and reasoning, from the record its PNG carries) and its PNG, behind the page's login.

An id is 16 random URL-safe characters (96 bits): a result is found by its link, never by guessing.
"""
from __future__ import annotations

import html
import re
import secrets
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

from fastapi import APIRouter
from starlette.requests import Request as HttpRequest
from starlette.responses import FileResponse, HTMLResponse, Response

from engine.serve.image_meta import NotARecord, read_record

MAX_RESULTS = 500                # results kept (the oldest go first)
MAX_RESULTS_MB = 2048            # and their bytes together
_NAME = re.compile(r"hunyuan-(?P<id>[A-Za-z0-9_-]{16})-seed\d+\.png")
_ID = re.compile(r"[A-Za-z0-9_-]{16}")


class ResultStore:
    def __init__(self, folder: str | Path | None = None, max_count: int = MAX_RESULTS,
                 max_mb: int = MAX_RESULTS_MB):
        if max_count < 1 or max_mb < 1:
            raise ValueError(f"a result store keeps at least 1 result and 1 MB (got {max_count}, {max_mb} MB)")
        self.temporary = folder is None
        self.folder = Path(tempfile.mkdtemp(prefix="hunyuan-results-") if folder is None else folder).resolve()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_count, self.max_bytes = max_count, max_mb << 20
        self._lock = threading.Lock()
        self._files: OrderedDict[str, tuple[Path, int]] = OrderedDict()     # id -> (file, bytes), oldest first
        found = [(p.stat(), m["id"], p) for p in self.folder.iterdir() if (m := _NAME.fullmatch(p.name))]
        for st, rid, path in sorted(found, key=lambda f: f[0].st_mtime):
            self._files[rid] = (path, st.st_size)
        self._bytes = sum(size for _, size in self._files.values())
        with self._lock:
            self._evict()
        if self.temporary:            # gone with the server (at exit, or when the store is dropped)
            weakref.finalize(self, shutil.rmtree, str(self.folder), True)

    @property
    def secret(self) -> str:
        """A secret that lasts as long as the results: what a page encrypts its stored history with, so that
        a page reloaded after a restart of a server with `--results-dir` still reads it."""
        path = self.folder / ".secret"
        with self._lock:
            if not path.exists():
                tmp = path.with_suffix(".tmp")
                tmp.write_text(secrets.token_urlsafe(24))
                tmp.replace(path)
            return path.read_text().strip()

    def add(self, png: bytes, seed: int) -> str:
        """Keep `png` (the image of `seed`, which its file name carries); its new id."""
        rid = secrets.token_urlsafe(12)
        path = self.folder / f"hunyuan-{rid}-seed{int(seed)}.png"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(png)
        tmp.replace(path)            # a reader never sees half a file
        with self._lock:
            self._files[rid] = (path, len(png))
            self._bytes += len(png)
            self._evict()
        return rid

    def path(self, rid: str) -> Path | None:
        """The file of result `rid`, or None (no such result, or no longer kept)."""
        if not isinstance(rid, str) or not _ID.fullmatch(rid):
            return None
        with self._lock:
            kept = self._files.get(rid)
        return kept[0] if kept is not None and kept[0].exists() else None

    def id_of(self, path: str | Path | None) -> str | None:
        """The id of a kept result, from the name of its file or of a copy of it (Gradio serves a copy, and a
        page's gallery gives that copy's path back); None for any other file, or one no longer kept."""
        if not path:
            return None
        m = _NAME.fullmatch(Path(path).name)
        return m["id"] if m is not None and self.path(m["id"]) is not None else None

    def __len__(self) -> int:
        return len(self._files)

    def _evict(self) -> None:
        while self._files and (len(self._files) > self.max_count or self._bytes > self.max_bytes):
            _, (path, size) = self._files.popitem(last=False)
            self._bytes -= size
            path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------- the links
RESULT_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
 body {{ font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1100px; padding: 0 1em; color: #1e293b; }}
 .result {{ display: flex; flex-wrap: wrap; gap: 1.5em; align-items: flex-start; }}
 .result img {{ max-width: min(100%, 640px); max-height: 80vh; object-fit: contain; border: 1px solid #cbd5e1; }}
 table {{ border-collapse: collapse; }} td, th {{ text-align: left; padding: 2px 10px 2px 0; vertical-align: top; }}
 th {{ color: #475569; font-weight: 600; }}
 pre {{ white-space: pre-wrap; background: #f1f5f9; padding: 0.75em; max-width: 100%; }}
 a.button {{ display: inline-block; margin: 0.5em 0.5em 0.5em 0; padding: 0.4em 0.9em; background: #4f46e5;
            color: white; text-decoration: none; border-radius: 6px; }}
</style></head><body>
<h1>{title}</h1>
<div class="result"><img id="image" src="{png}" alt="{alt}">
<div><table id="settings">{rows}</table>
<a class="button" id="download" href="{png}" download="{file}">Download PNG</a>
<a class="button" id="open" href="{studio}?result={rid}">Open these settings in the studio</a></div></div>
<h2>Reasoning</h2><pre id="reasoning">{reasoning}</pre>
<p>A result of this server, kept while it keeps its last results (a server started without --results-dir
forgets them when it stops). The PNG carries these settings in its text chunks.</p>
</body></html>"""


def result_page(rid: str, record: dict[str, Any], studio: str = "../") -> str:
    """The read-only page of a result: its image, its settings, its reasoning, its timings."""
    e = html.escape
    t = record.get("timings") or {}
    shown = [("Prompt", record.get("prompt")), ("Model", record.get("model")), ("Seed", record.get("seed")),
             ("Reasoning mode", record.get("mode")), ("Steps", record.get("steps")),
             ("Guidance", record.get("guidance")), ("Size", f"{record.get('size')} (asked: {record.get('size_asked')})"),
             ("Step cache", record.get("step_cache")),
             ("Adapter", f"{record['lora']} at {record.get('lora_scale')}" if record.get("lora") else "none"),
             ("System prompt", record.get("system_prompt")), ("Reasoning length", record.get("max_new_tokens")),
             ("Reference images", record.get("references")),
             ("Engine time", f"{t['total_s']:.2f} s" if t.get("total_s") else None)]
    rows = "".join(f"<tr><th>{e(k)}</th><td>{e(str(v))}</td></tr>" for k, v in shown if v not in (None, ""))
    prompt = str(record.get("prompt") or "")
    return RESULT_PAGE.format(title=e(f"Result {rid}"), png=e(f"{rid}.png"), alt=e(prompt[:200]), rows=rows,
                              file=e(f"hunyuan-{rid}-seed{record.get('seed')}.png"), studio=e(studio), rid=e(rid),
                              reasoning=e(str(record.get("reasoning") or "(no reasoning: reasoning was off)")))


def results_router(store: ResultStore, allowed: Callable[[HttpRequest], bool], studio: str = "../") -> APIRouter:
    """GET /results/{id} (the result's page) and /results/{id}.png (its PNG): read-only, each request checked
    by `allowed(request)` (the page's login), 404 for an id the server does not keep."""
    router = APIRouter()

    @router.get("/results/{name}")
    def result(name: str, request: HttpRequest) -> Response:
        if not allowed(request):
            return HTMLResponse('<p>This studio asks for a login: open <a href="../">its page</a>, log in, then '
                                "this link again.</p>", status_code=401)
        rid, png = (name[:-4], True) if name.endswith(".png") else (name, False)
        path = store.path(rid)
        if path is None:
            return HTMLResponse(f"<p>No result {html.escape(rid)} on this server: it keeps its last "
                                f"{store.max_count} results, and forgets them when it stops unless it was started "
                                "with --results-dir.</p>", status_code=404)
        if png:
            return FileResponse(path, media_type="image/png", headers={"Cache-Control": "private, max-age=3600"})
        try:
            record = read_record(path.read_bytes())
        except NotARecord:
            record = {}
        return HTMLResponse(result_page(rid, record, studio))
    return router
