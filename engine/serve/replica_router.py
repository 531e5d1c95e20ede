"""Ray Serve's request router for the engine replicas (engine/serve/replicas.py): least-loaded. Imports
Ray at the top, so only Ray Serve loads it (by its path, on whatever node routes a request)."""
from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class LeastLoadedRouter(RequestRouter):
    """Offers every replica in one rank: Ray Serve probes their queue lengths (a replica's ongoing requests,
    which for a streamed image request last from submit to its last event: the engine's queued + running
    work) and sends the request to the shortest queue that has room, the first of equals: shuffled, so
    that equal ones share the work (in a fixed order a burst on an idle pool would all go to the first).
    Power of two choices, Ray Serve's default, compares two random replicas: with long image requests a
    third may sit idle while those two queue.

    Queue lengths are probed for every request, never read from Ray Serve's per-router cache: that cache
    counts a request until its replica reports again (up to 10 s), so right after a cancelled request it
    still showed the freed replica busy and a tie sent the next one to the replica that was (CI saw a
    conversation's turn 2 land beside a running request). One probe per long image request costs nothing."""

    def __init__(self, *args, **kwargs):
        kwargs["use_replica_queue_len_cache"] = False
        super().__init__(*args, **kwargs)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ranked = list(candidate_replicas)
        random.shuffle(ranked)
        return [ranked]
