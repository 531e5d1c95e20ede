"""Engine replicas on Ray Serve: several copies of the engine behind one page and one /v1 (docs/design.md, Adapters, conversations, replicas).

    pool = ReplicaPool(EngineConfig(model, device="cuda", max_batch=8), ReplicaOptions(replicas=2, gpus_per_replica=4))
    sub = pool.submit(Request(prompt="a red fox"))      # EngineServer's client API, unchanged
    async for ev in sub: ...                             # pool.cancel(id), pool.position(id), pool.health()

Each replica is a Ray Serve deployment replica that owns one `EngineServer` (its worker processes, the
model resident on the replica's own GPUs: Ray gives the replica actor `gpus_per_replica` GPUs and sets
CUDA_VISIBLE_DEVICES, which the engine's workers inherit). This process stays the ingress: the page and
/v1 are built on the pool exactly as on one EngineServer, so clients see no difference.

- Routing: least-loaded (engine/serve/replica_router.py), by Ray Serve's count of a replica's ongoing
  requests, which for a streamed request lasts from submit to its last event: its queued + running work.
- Streams: a request is one streaming handle call; each engine event is relayed as it comes. While a
  request waits in its replica's queue, the replica also sends `Waiting(ahead)` once a second, which is
  what `position` answers.
- Cancel and disconnect: cancelling the handle call reaches the replica that holds the request (Ray
  Serve cancels its generator there), which cancels it on its engine.
- Failure: a replica that dies fails the requests it held with a message; Ray Serve's controller sees
  the dead actor at its next health check and starts a replacement, which loads the model once.
- Health: each replica posts its engine's health to a small named actor (`HealthBoard`) every second;
  `health()` reports every replica and the total.
- Autoscaling: with min < max replicas, Ray Serve's autoscaler scales on ongoing requests per replica
  (the queue depth), aiming at `max_batch` each; `health()` reports the replicas it keeps (`replicas_target`).
- Validation: the ingress admits every request (engine/serve/admission.py: seed, fields, adapters, images
  read) and ships it prepared; the replica's engine queues it as admitted, without a second check.
- Conversations are held here, at the ingress, not in a replica: a turn is admitted with the
  conversation's turns as its history (engine/serve/turns.py, as one EngineServer does it) and goes to the
  least-loaded replica like any request; the ingress records the turn from the events it relays. Why not
  sticky routing (a conversation pinned to the replica that holds it): a replica that dies, or that the
  autoscaler removes, would take its conversations with it, and a pinned turn would wait behind a busy
  replica while another sits idle. The cost is the history's images travelling with each turn (a few
  MB at most, against a request of seconds). A prefix cache held per replica would want the turn on the
  replica of its previous turn: that belongs in the router as a preference among equally loaded ones.
- LoRA adapters: the ingress holds the set every replica must serve (the `--lora` ones, then those
  loaded and unloaded through it) on the health board; each replica loads and unloads to match it at its
  next report, and a replica that Ray starts later loads the set at start. `load_adapter` returns once
  every replica up has it (or undoes it, naming the replica that could not); `adapters()`, which
  /v1/models lists and requests are checked against, names those that every replica up holds.

Ray is imported here only, and only when a pool is built: without --replicas nothing imports it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from engine.serve.conversation import ConversationStore, TurnRecorder
from engine.runtime.events import Done, Error
from engine.runtime.request import Prepared, Request
from engine.serve.adapters import Loras, check_load, check_unload
from engine.serve.admission import admit
from engine.serve.client import EngineClient, Submission
from engine.serve.engine_config import EngineConfig
from engine.serve.info import ModelInfo
from engine.serve.turns import submit_turn

APP_NAME = "hunyuan-engine"
NAMESPACE = "hunyuan-studio"
BOARD_NAME = "hunyuan-engine-health"
REPORT_EVERY_S = 1.0          # a replica posts its health this often
STALE_AFTER_S = 5.0           # a replica silent this long is reported "lost" (dead, or being replaced)
FORGET_AFTER_S = 30.0         # ... and this long, no longer reported
WAITING_EVERY_S = 1.0         # a queued request's position is sent this often
ROUTER = "engine.serve.replica_router:LeastLoadedRouter"    # imported by Ray Serve where it routes
HEALTH_CHECK_S = 2.0          # Ray Serve's health check period: how soon a dead replica is replaced
ADAPTER_WAIT_S = 120.0        # how long a LoRA load waits for every replica up to have it


@dataclass(frozen=True)
class ReplicaOptions:
    """How many engines and where. `min_replicas`/`max_replicas` (both or neither) turn on Ray Serve's
    autoscaler, starting at `replicas`; `ray_address` joins a running cluster (None: a local Ray)."""
    replicas: int
    gpus_per_replica: float | None = None     # engine ranks per replica (None: the plan's, else 1); a fraction
                                              # (0.5): one rank sharing a GPU with other replicas (small models)
    min_replicas: int | None = None
    max_replicas: int | None = None
    ray_address: str | None = None
    upscale_delay_s: float = 30.0             # the autoscaler's delays (Ray Serve's defaults): how long the
    downscale_delay_s: float = 600.0          # queue must stay above / below the target before it acts

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1 (got {self.replicas})")
        g = self.gpus_per_replica
        if g is not None and not (0 < g < 1 or (g >= 1 and g == int(g))):
            raise ValueError(f"gpus_per_replica must be a whole number of GPUs, or a fraction of one GPU below 1 "
                             f"(got {g})")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("min_replicas and max_replicas go together (autoscaling between them)")
        if self.min_replicas is not None and not 0 < self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(f"autoscaling needs 1 <= min_replicas <= replicas <= max_replicas (got "
                             f"{self.min_replicas} <= {self.replicas} <= {self.max_replicas})")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError(f"the autoscaling delays are seconds >= 0 (got {self.upscale_delay_s}, "
                             f"{self.downscale_delay_s})")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None and self.min_replicas < self.max_replicas


@dataclass
class Waiting:
    """Sent by a replica while a request is queued there: how many requests wait ahead of it."""
    ahead: int | None


# ---------------------------------------------------------------------------------------- replica side
class EngineReplica:
    """The body of one replica: one EngineServer, its health posted to the board. Ray Serve wraps this
    class (`serve.deployment` in `ReplicaPool._deploy`), so it is plain Python here."""

    def __init__(self, config: EngineConfig, step_timeout: float | None) -> None:
        import ray
        from ray import serve
        from engine.serve.server import EngineServer
        self._board = ray.get_actor(BOARD_NAME, namespace=NAMESPACE)
        self._adapters_epoch, loras = ray.get(self._board.loras.remote(), timeout=30)
        # the adapters the pool serves now
        self.server = EngineServer(dataclasses.replace(config, loras=loras), step_timeout=step_timeout)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node = ray.get_runtime_context().get_node_id()
        self.gpus = [str(g) for g in ray.get_gpu_ids()]
        self._reload_epoch: int | None = None
        self.adapter_errors: dict[str, str] = {}   # adapter name -> why this engine could not load it
        self.served = 0                         # requests this replica finished with their result
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report_loop, name="replica-health", daemon=True)
        self._reporter.start()

    async def generate(self, request: Request, prepared: Prepared):
        """The request's events as the engine emits them, with `Waiting` while it is queued. A cancel of
        the handle call (Stop, a closed page, a gone client) arrives here as the generator's end. The
        ingress admitted it (engine/serve/admission.py): the engine runs it as prepared there."""
        sub = self.server.submit_admitted(request, prepared)
        try:
            while True:
                ev = await sub.aget(timeout=WAITING_EVERY_S)
                if ev is None:
                    yield Waiting(self.server.position(request.request_id))
                    continue
                yield ev
                if isinstance(ev, (Done, Error)):
                    self.served += isinstance(ev, Done)
                    return
        finally:
            if not sub.ended:
                self.server.cancel(request.request_id)

    def check_health(self) -> None:
        """Ray Serve's health check: a closed engine cannot serve (a failed one can, after a reload)."""
        if self.server.health()["state"] == "closed":
            raise RuntimeError("the engine server is closed")

    def report(self) -> dict[str, Any]:
        h = self.server.health()
        return {"id": self.replica_id, "node": self.node, "pid": os.getpid(), "gpus": self.gpus, "served": self.served,
                **{k: h.get(k) for k in ("state", "plan", "world_size", "device", "running", "waiting", "max_queue",
                                         "max_batch", "last_error", "restarts", "attempt", "loading",
                                         "worker_pids")},
                "adapters": self.server.adapters(), "adapters_epoch": self._adapters_epoch,
                "adapter_errors": dict(self.adapter_errors)}

    def _report_loop(self) -> None:
        while not self._stop.wait(REPORT_EVERY_S):
            try:
                import ray
                epoch, (adapters_epoch, loras) = ray.get(self._board.put.remote(self.report()), timeout=10)
            except Exception as e:  # noqa: BLE001 - the board may be restarting; the engine keeps serving
                print(f"replica {self.replica_id}: health report failed: {e}", file=sys.stderr, flush=True)
                continue
            if self._reload_epoch is not None and epoch > self._reload_epoch:
                self.server.reload()            # a no-op unless this engine failed to load
            self._reload_epoch = epoch
            self._sync_adapters(adapters_epoch, loras)

    def _sync_adapters(self, epoch: int, wanted: Loras) -> None:
        """Load and unload LoRA adapters until this engine serves the pool's set (`wanted`, of `epoch`): the
        next report says which epoch it has matched, and what it could not load."""
        if epoch != self._adapters_epoch:
            self.adapter_errors = {}              # a new set: try again what failed before
        for name, folder in self.server.config.loras:
            if (name, folder) not in wanted:
                try:
                    self.server.unload_adapter(name)
                except (KeyError, ValueError):    # still used by a request here: the next report tries again
                    pass
        for name, folder in wanted:
            if (name, folder) not in self.server.config.loras and name not in self.adapter_errors:
                try:
                    self.server.load_adapter(name, folder)
                except (ValueError, OSError) as e:
                    # /health shows it to anyone: the folder by its name, not the server's path
                    self.adapter_errors[name] = str(e).replace(str(folder), Path(folder).name)
        self._adapters_epoch = epoch

    def __del__(self) -> None:       # Ray Serve's graceful stop (scale down, shutdown): free the GPUs
        self._stop.set()
        self.server.close()


class HealthBoard:
    """The replicas' latest health, keyed by replica id and stamped on this actor's clock; also the
    pool's reload request (an epoch the replicas compare with the last they saw) and the LoRA adapters
    every replica is to serve (with the epoch of each change)."""

    def __init__(self) -> None:
        self.reports: dict[str, tuple[float, dict]] = {}
        self.reload_epoch = 0
        self.adapters: tuple[int, Loras] = (0, ())

    def put(self, report: dict) -> tuple[int, tuple[int, Loras]]:
        self.reports[report["id"]] = (time.time(), report)
        return self.reload_epoch, self.adapters

    def loras(self) -> tuple[int, Loras]:
        return self.adapters

    def set_loras(self, loras: Loras) -> int:
        self.adapters = (self.adapters[0] + 1, tuple(loras))
        return self.adapters[0]

    def snapshot(self) -> list[dict]:
        now = time.time()
        for rid in [r for r, (t, _) in self.reports.items() if now - t > FORGET_AFTER_S]:
            del self.reports[rid]                 # gone for good: Ray Serve has replaced it by now
        return [{**rep, "age_s": round(now - t, 1)} for t, rep in self.reports.values()]

    def reload(self) -> None:
        self.reload_epoch += 1


def deployment_options(o: ReplicaOptions, world: int, max_batch: int, max_queue: int | None, cuda: bool) -> dict:
    """The replicas' Ray Serve deployment options (plain values: no Ray needed to read them)."""
    # Ray places each replica where its GPUs are free (a fraction: replicas sharing one); on the CPU each
    # engine rank is a process
    gpus = o.gpus_per_replica if o.gpus_per_replica and o.gpus_per_replica < 1 else world
    actor = {"num_gpus": gpus, "num_cpus": 1} if cuda else {"num_cpus": world}
    scale = ({"autoscaling_config": {"min_replicas": o.min_replicas, "max_replicas": o.max_replicas,
                                     "initial_replicas": o.replicas, "target_ongoing_requests": max_batch,
                                     "upscale_delay_s": o.upscale_delay_s, "downscale_delay_s": o.downscale_delay_s}}
             if o.autoscaling else {"num_replicas": o.replicas})
    return dict(ray_actor_options=actor, max_ongoing_requests=max_batch + (max_queue or 0),  # the engine's queue
                health_check_period_s=HEALTH_CHECK_S, health_check_timeout_s=30, graceful_shutdown_timeout_s=30,
                request_router_config={"request_router_class": ROUTER}, **scale)


# ---------------------------------------------------------------------------------------- ingress side
class ReplicaPool(EngineClient):
    """EngineServer's client API (submit, submit_turn, cancel, position, health, reload, close, info, and the
    LoRA adapters') over engine replicas on Ray Serve."""

    def __init__(self, config: EngineConfig, options: ReplicaOptions, *, max_queue: int | None = None,
                 step_timeout: float | None = None) -> None:
        """Replicas of the engine `config` describes (each one's ranks: `options.gpus_per_replica`, else the
        config's), checked here against the checkpoint as one engine checks it, before any replica starts.
        `max_queue` and `step_timeout` are EngineServer's: the requests that may wait on each replica, each
        replica's stall limit."""
        import ray
        from ray import serve
        self.options = options
        self.info = ModelInfo.from_folder(config.model)
        g = options.gpus_per_replica
        config = dataclasses.replace(config, world_size=max(1, int(g)) if g else config.world_size).with_plan()
        config = config.for_checkpoint(self.info)
        self.model, self.plan, self.world_size = config.model, config.plan, config.world_size
        self.max_batch, self.max_queue = config.max_batch, max_queue
        self._lora_slots, self._max_lora_rank, self._lora_mlp = config.lora_slots, config.max_lora_rank, config.lora_mlp
        self._loras: Loras = config.loras          # the adapters every replica serves (loaded from the board)
        self._adapter_lock = threading.Lock()     # one load or unload at a time
        self.conversations = ConversationStore()  # held here, at the ingress (the module's docstring says why)
        self._connected = not ray.is_initialized()            # ray.init here: ray.shutdown at close
        self._local_ray = self._connected and options.ray_address is None   # ... which stops this local Ray
        if self._connected:
            ray.init(address=options.ray_address, namespace=NAMESPACE, include_dashboard=False)
        device = config.device
        if device == "auto":                       # the replicas' machines decide, not this one
            device = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
        self.device = device
        if device.startswith("cuda"):              # Ray would wait for GPUs that never come: say so now
            have, per = ray.cluster_resources().get("GPU", 0), options.gpus_per_replica or config.world_size
            if have < per * options.replicas:      # (serve.run waits for every replica it starts with)
                if self._connected:
                    ray.shutdown()
                raise ValueError(f"{options.replicas} replicas of {per:g} GPU(s) need {per * options.replicas:g} "
                                 f"GPUs; the Ray cluster has {have:g}")
        # Ray Serve admits at most max_batch + max_queue requests to a replica (max_ongoing_requests); the
        # replica's engine takes whatever Ray admits: its own count lags Ray's by the moment between an
        # ended stream and the engine forgetting it, so a second limit there refused requests Ray had
        # found room for (a 429 with room free, seen under CI load)
        self._replica_config = dataclasses.replace(config, device=device, loras=(), max_loras=self._lora_slots)
        self._step_timeout = step_timeout
        self._board = ray.remote(num_cpus=0)(HealthBoard).options(
            name=BOARD_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime=None).remote()
        ray.get(self._board.set_loras.remote(self._loras), timeout=30)     # before a replica starts: they load it
        self._handle = self._deploy(serve)
        self._streams: dict[str, Any] = {}         # request id -> its handle call (DeploymentResponseGenerator)
        self._subs: dict[str, Submission] = {}
        self._ahead: dict[str, int | None] = {}
        self._lock = threading.Lock()
        self._replicas: list[dict] = []
        self._target = options.replicas           # the replicas Ray Serve keeps (the autoscaler's choice)
        self._closing = False
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="replica-pool", daemon=True)
        self._loop_thread.start()
        self._refresh_stop = threading.Event()
        self._refresh()
        self._refresher = threading.Thread(target=self._refresh_loop, name="replica-health", daemon=True)
        self._refresher.start()

    def _deploy(self, serve: Any) -> Any:
        options = deployment_options(self.options, self.world_size, self.max_batch, self.max_queue,
                                     cuda=self.device.startswith("cuda"))
        serve.start(proxy_location="Disabled")    # this process is the ingress: no Ray HTTP proxy
        dep = serve.deployment(EngineReplica).options(name="EngineReplica", **options)
        return serve.run(dep.bind(self._replica_config, self._step_timeout), name=APP_NAME, route_prefix=None)

    # ------------------------------------------------------------------ client API (EngineServer's)
    def submit(self, request: Request, recorder: Callable[[Request, Prepared], TurnRecorder] | None = None
               ) -> Submission:
        """Admit the request here (engine/serve/admission.py: a refusal ends the stream at once, as
        EngineServer's does), then send it, prepared, to the least-loaded replica; its events follow as that
        engine emits them. `recorder` (submit_turn's): sees the events before the client does."""
        admitted = admit(self.info, request, self.adapters())
        if isinstance(admitted, Error):
            return Submission.refused(request, admitted, self.cancel)
        request, prepared = admitted
        sub = Submission(request, self.cancel)
        rid = request.request_id
        with self._lock:
            live = [r for r in self._replicas if r["state"] not in ("lost", "failed", "closed")]
            capacity = max(1, len(live)) * (self.max_batch + (self.max_queue if self.max_queue is not None else 10 ** 9))
            if self._closing:
                sub.push(Error("engine", "the engine is shut down"))
            elif rid in self._subs:
                sub.push(Error("invalid", f"request id {rid!r} is already in use", "request_id"))
            elif len(self._subs) >= capacity:
                sub.push(Error("busy", f"the queue is full ({len(self._subs)} requests on {len(live)} replica(s)); "
                                        "try again in a moment"))
            else:
                self._subs[rid] = sub
                rec = recorder(request, prepared) if recorder is not None else None
                asyncio.run_coroutine_threadsafe(self._relay(sub, request, prepared, rec), self._loop)
        return sub

    def submit_turn(self, request: Request, conversation: str | None = None,
                    branch_from_turn: int | None = None) -> Submission:
        """A conversation's next turn (engine.serve.turns.submit_turn, on the ingress's store): any replica
        may run it, its history travels with it."""
        return submit_turn(self, self.conversations, request, conversation, branch_from_turn)

    def stream(self, request: Request):
        return iter(self.submit(request))

    def cancel(self, request_id: str) -> bool:
        """Stop a request on the replica that holds it; it ends here at once with Error('cancelled')."""
        with self._lock:
            sub = self._subs.get(request_id)
            if sub is None or sub.ended:
                return False
            queued = self._ahead.get(request_id, None) is not None
        sub.push(Error("cancelled", "stopped before it started" if queued else "stopped by the user"))
        self._loop.call_soon_threadsafe(self._cancel_call, request_id)
        return True

    def position(self, request_id: str) -> int | None:
        """How many wait ahead of this request on its replica (None: it runs, or it is not known yet)."""
        return self._ahead.get(request_id)

    def health(self) -> dict[str, Any]:
        """The total (state, counts, as one EngineServer reports them) plus `replicas`: each one's state,
        plan, GPUs, node, queue. Read from the board once a second, so this never waits on Ray."""
        with self._lock:
            reps = [dict(r) for r in self._replicas]
            closing = self._closing
        up = [r for r in reps if r["state"] in ("ready", "busy")]
        state = ("closed" if closing else "ready" if any(r["state"] == "ready" for r in up) else "busy" if up
                 else "restarting" if any(r["state"] in ("restarting", "stalled") for r in reps)
                 else "failed" if reps and all(r["state"] == "failed" for r in reps) else "loading")
        failed = [r for r in reps if r.get("last_error")]
        waiting = sum(r.get("waiting") or 0 for r in reps)
        return {
            "state": state, "model": self.model, "model_name": self.info.name, "device": self.device,
            "world_size": self.world_size, "plan": self.plan,
            "running": sum(r.get("running") or 0 for r in reps), "waiting": waiting, "queue": waiting,
            "max_batch": self.max_batch * max(1, len(up)),
            "max_queue": None if self.max_queue is None else self.max_queue * max(1, len(up)),
            "loading": next((r["loading"] for r in reps if r.get("loading")), None),
            "last_error": failed[0]["last_error"] if failed else None,
            "restarts": sum(r.get("restarts") or 0 for r in reps),
            "attempt": max((r.get("attempt") or 0 for r in reps), default=0),
            "restart_in_s": None, "stall_limit_s": None,
            "replicas": reps, "replicas_up": len(up), "replicas_target": self._target,
            "replicas_min": self.options.min_replicas, "replicas_max": self.options.max_replicas,
        }

    # ------------------------------------------------------------------ LoRA adapters (every replica's)
    def merged_adapter(self) -> None:
        """Replicas serve adapters unmerged (app.py refuses --lora-merged with --replicas)."""
        return None

    def adapters(self) -> list[str]:
        """The LoRA adapters served: the pool's set, as far as every replica up holds them."""
        with self._lock:
            live = [r for r in self._replicas if r["state"] in ("ready", "busy")]
            return [n for n, _ in self._loras if all(n in (r.get("adapters") or ()) for r in live)]

    def load_adapter(self, name: str, folder: str | Path) -> None:
        """Serve another LoRA adapter on every replica, checked here as one engine checks it; returns once
        every replica up has loaded it. ValueError when it cannot be (then no replica keeps it)."""
        with self._adapter_lock:
            with self._lock:
                before = self._loras
            folder = check_load(self.info, before, self._lora_slots, self._max_lora_rank, name, folder,
                                self._lora_mlp)
            with self._lock:
                self._loras = before + ((name, folder),)
            failed = self._publish_adapters(name)
            if failed:
                with self._lock:
                    self._loras = before
                self._publish_adapters(None)      # the replicas that loaded it unload it
                raise ValueError(f"LoRA adapter {name!r} was not loaded on every replica: {failed}")

    def unload_adapter(self, name: str) -> None:
        """Stop serving a LoRA adapter on every replica; refused (ValueError) while a request uses it."""
        with self._adapter_lock:
            with self._lock:
                users = [rid for rid, sub in self._subs.items() if sub.request.lora == name and not sub.ended]
                self._loras = check_unload(self._loras, name, users)     # no request is admitted with it from now
            self._publish_adapters(None)

    def _publish_adapters(self, name: str | None) -> str | None:
        """Post the pool's adapter set to the board; with `name`, wait until every replica up has matched
        it and say which could not load `name` (None: all did)."""
        import ray
        with self._lock:
            loras = self._loras
        epoch = ray.get(self._board.set_loras.remote(loras), timeout=30)
        if name is None:
            return None
        deadline = time.monotonic() + ADAPTER_WAIT_S
        while True:
            with self._lock:
                live = [r for r in self._replicas if r["state"] in ("ready", "busy")]
            if all((r.get("adapters_epoch") or 0) >= epoch for r in live):
                errors = [f"replica {r['id']}: {r['adapter_errors'][name]}" for r in live
                          if name in (r.get("adapter_errors") or {})]
                return "; ".join(errors) or None
            if time.monotonic() > deadline:
                late = [r["id"] for r in live if (r.get("adapters_epoch") or 0) < epoch]
                return f"replica(s) {', '.join(late)} did not load it within {ADAPTER_WAIT_S:.0f} s"
            time.sleep(0.1)

    def reload(self) -> bool:
        """Ask every replica whose model failed to load to load it again (they see it at their next report)."""
        import ray
        if not any(r["state"] == "failed" for r in self._replicas):
            return False
        ray.get(self._board.reload.remote(), timeout=10)
        return True

    def wait_ready(self, timeout: float | None = None, replicas: int = 1) -> bool:
        """Block until `replicas` replicas are ready (True) or the time runs out (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.health()["replicas_up"] < replicas:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """End every pending request, delete the replicas (their engines stop) and, when this pool
        started Ray, stop it. Idempotent."""
        import ray
        from ray import serve
        with self._lock:
            if self._closing:
                return
            self._closing = True
            pending = list(self._subs.values())
        for sub in pending:
            sub.push(Error("engine", "the engine was shut down"))
        self._refresh_stop.set()
        try:
            serve.delete(APP_NAME)
            if self._local_ray:                     # a cluster's Serve may hold others' apps: left running
                serve.shutdown()
            ray.kill(self._board)
        except Exception as e:  # noqa: BLE001 - a cluster that is already gone has nothing to delete
            print(f"replica pool: shutdown: {e}", file=sys.stderr, flush=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout)
        if self._connected:
            ray.shutdown()

    def __enter__(self) -> "ReplicaPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    async def _relay(self, sub: Submission, request: Request, prepared: Prepared,
                     recorder: TurnRecorder | None) -> None:
        """Pass one request's events from its replica to its Submission, one by one (a conversation's turn:
        its recorder sees each first, so the turn is recorded before its client can send the next)."""
        from ray.exceptions import RayError
        from ray.serve.exceptions import BackPressureError, RequestCancelledError
        rid = request.request_id
        call, finished = None, False
        try:
            if sub.ended:                           # cancelled before it was sent
                return
            call = self._handle.options(stream=True).generate.remote(request, prepared)
            self._streams[rid] = call
            async for item in call:
                if sub.ended:                       # cancelled here meanwhile: the finally stops the replica's run
                    break
                if isinstance(item, Waiting):
                    self._ahead[rid] = item.ahead
                    continue
                self._ahead.pop(rid, None)
                if recorder is not None:
                    recorder.see(item)
                sub.push(item)
                if isinstance(item, (Done, Error)):
                    finished = True
                    break
        except (RequestCancelledError, asyncio.CancelledError):
            pass                                    # cancel() has answered the client already
        except BackPressureError:
            sub.push(Error("busy", "every replica's queue is full; try again in a moment"))
        except RayError as e:                       # the replica died (killed, out of memory, its node lost)
            sub.push(Error("engine", f"the engine replica running this request stopped ({_first_line(e)}); "
                                      "it is being replaced, try again"))
        except Exception as e:  # noqa: BLE001 - whatever it was, the client hears it and the pool goes on
            sub.push(Error("engine", f"the request to its engine replica failed: {type(e).__name__}: {e}"))
        finally:
            if call is not None and not finished:
                call.cancel()                       # a no-op once the replica's generator has ended
            if not sub.ended:
                sub.push(Error("engine", "the engine replica ended the request without a result"))
            self._streams.pop(rid, None)
            self._ahead.pop(rid, None)
            with self._lock:
                self._subs.pop(rid, None)

    def _cancel_call(self, request_id: str) -> None:
        call = self._streams.get(request_id)
        if call is not None:
            call.cancel()                           # Ray Serve cancels the generator on its replica

    def _refresh_loop(self) -> None:
        while not self._refresh_stop.wait(REPORT_EVERY_S):
            self._refresh()

    def _refresh(self) -> None:
        import ray
        try:
            reps = ray.get(self._board.snapshot.remote(), timeout=5)
        except Exception as e:  # noqa: BLE001 - keep the last view; say why
            print(f"replica pool: health board unreachable: {e}", file=sys.stderr, flush=True)
            return
        for r in reps:
            if r["age_s"] > STALE_AFTER_S:
                r["state"] = "lost"
        target = self._autoscaled_target() if self.options.autoscaling else self.options.replicas
        with self._lock:
            self._replicas = sorted(reps, key=lambda r: r["id"])
            self._target = target if target is not None else self._target

    def _autoscaled_target(self) -> int | None:
        """How many replicas Ray Serve keeps now (running or starting; not those stopping)."""
        from ray import serve
        try:
            dep = serve.status().applications[APP_NAME].deployments["EngineReplica"]
        except Exception as e:  # noqa: BLE001 - deploying, or the controller busy: keep the last figure
            print(f"replica pool: Serve status unreadable: {e}", file=sys.stderr, flush=True)
            return None
        return sum(n for state, n in dep.replica_states.items() if str(getattr(state, "value", state)) != "STOPPING")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
