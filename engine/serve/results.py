"""Finished images kept on this server, so that a page can show them again (its history after a reload, its
edit thread) and a link can open one: PNG files under random ids, bounded in count and bytes (the oldest
go first). In a temporary folder that goes with the server, or in a folder given (`--results-dir`) that
keeps them for the next start.

An id is 16 random URL-safe characters (96 bits): a result is found by its link, never by guessing.
"""
from __future__ import annotations

import re
import secrets
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from pathlib import Path

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
        """The id of a kept result's file (a path a page holds), or None for any other path."""
        if not path:
            return None
        m = _NAME.fullmatch(Path(path).name)
        if m is None or Path(path).resolve().parent != self.folder:
            return None
        return m["id"] if self.path(m["id"]) is not None else None

    def __len__(self) -> int:
        return len(self._files)

    def _evict(self) -> None:
        while self._files and (len(self._files) > self.max_count or self._bytes > self.max_bytes):
            _, (path, size) = self._files.popitem(last=False)
            self._bytes -= size
            path.unlink(missing_ok=True)
