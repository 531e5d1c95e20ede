"""Where a request enters the engine (docs/design.md, Serving runtime: a request is validated once where it
enters): its seed drawn, its fields checked and defaults resolved against the checkpoint and the LoRA
adapters served, its reference images read into bytes. `EngineServer.submit` and `ReplicaPool.submit` both admit through here;
a replica runs what its ingress admitted (`EngineServer.submit_admitted`) without checking it again."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Collection

from engine.runtime.events import Error
from engine.runtime.request import Prepared, Request, RequestError, with_seed
from engine.serve.info import ModelInfo


def admit(info: ModelInfo, request: Request, adapters: Collection[str], merged: tuple[str, float] | None = None
          ) -> tuple[Request, Prepared] | Error:
    """The request as it will run (its seed fixed, its images bytes) and its Prepared form, or the
    Error('invalid') that refuses it, naming the field at fault (`merged`: the adapter folded into the
    weights and its strength, the only one such an engine serves)."""
    try:
        request = with_seed(request)           # drawn once, here: the seed reported is the seed used
        prepared = info.prepare(request, adapters, merged)
        request = detach_images(request)
    except (RequestError, TypeError, ValueError) as e:     # TypeError: a value of the wrong kind
        return Error("invalid", str(e), getattr(e, "field", None))
    except OSError as e:                                  # an upload that vanished after validation
        return Error("invalid", f"a reference image cannot be read: {e}", "images")
    return request, prepared


def detach_images(req: Request) -> Request:
    """Reference images given as paths are read now, so a temporary upload may vanish after submit (and a
    replica on another machine gets the bytes)."""
    if not req.images or all(not isinstance(i, (str, os.PathLike)) for i in req.images):
        return req
    return dataclasses.replace(req, images=[Path(i).read_bytes() if isinstance(i, (str, os.PathLike)) else i
                                            for i in req.images])
