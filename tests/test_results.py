"""The results the server keeps (engine/serve/results.py): files, no engine."""
from __future__ import annotations

import io

from PIL import Image as PILImage

from engine.serve.results import ResultStore


def png(size=(24, 16), color=(10, 20, 30)) -> bytes:
    buf = io.BytesIO()
    PILImage.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_the_store_keeps_the_newest_results_bounded_in_count(tmp_path):
    store = ResultStore(tmp_path / "r", max_count=3)
    ids = [store.add(png(color=(i, 0, 0)), seed=i) for i in range(5)]
    assert [store.path(i) is not None for i in ids] == [False, False, True, True, True] and len(store) == 3
    assert store.path(ids[4]).name == f"hunyuan-{ids[4]}-seed4.png"
    assert store.id_of(store.path(ids[3])) == ids[3]
    assert store.id_of(tmp_path / "copy" / f"hunyuan-{ids[3]}-seed3.png") == ids[3]   # a copy (Gradio's) names it
    assert store.id_of(tmp_path / f"hunyuan-{ids[0]}-seed0.png") is None          # no longer kept
    assert store.id_of(tmp_path / "photo.png") is None
    assert store.path("../../etc/passwd") is None and store.path(ids[0]) is None
    again = ResultStore(tmp_path / "r")                                          # --results-dir: kept
    assert [again.path(i) is not None for i in ids] == [False, False, True, True, True]
    assert again.secret == store.secret


def test_the_store_is_bounded_in_bytes_and_a_temporary_one_goes(tmp_path):
    big = png(size=(512, 512)) + b"\0" * (600 << 10)            # 0.6 MB
    store = ResultStore(tmp_path / "b", max_mb=1)
    first, second = store.add(big, 1), store.add(big, 2)
    assert store.path(first) is None and store.path(second) is not None
    temp = ResultStore()
    folder = temp.folder
    temp.add(png(), 1)
    assert folder.exists()
    del temp
    import gc
    gc.collect()
    assert not folder.exists()
