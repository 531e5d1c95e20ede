"""Start the HunyuanImage-3.0 studio: the engine server (model resident in its own process) + the web page.

    python app.py                                   # the embedded default model, on this machine's device
    python app.py --model /models/HunyuanImage-3.0-Instruct --device cuda --port 7860 --auth me:secret

Every flag is described in the README's "Studio" section and in `python app.py --help`.
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
from pathlib import Path

from engine import EMBEDDED_MODEL
EMBEDDED_NOTICE = ("This is the small **embedded demo model** (9.7 M parameters with the HunyuanImage-3.0 "
                   "architecture). It knows simple scenes: circles, squares, triangles, diamonds and stars in "
                   "red, orange, yellow, green, blue or purple, on white, gray or black, and edits that "
                   "recolor, move, add or remove a shape, change the background or combine 2-3 images. "
                   "Try the examples, with reasoning on Think + recaption (the default): it draws what was "
                   "asked far more often than Off or Think. Start the studio with `--model DIR` to serve "
                   "HunyuanImage-3.0-Instruct or -Instruct-Distil.")


def default_model() -> tuple[Path, str]:
    """The embedded model under assets/ and the page's note on it. It ships in the repository, so a missing
    folder is a broken checkout: say which folder (the run time never makes a stand-in: that needs tools/)."""
    if not (EMBEDDED_MODEL / "config.json").exists():
        raise FileNotFoundError(f"the embedded model is missing: {EMBEDDED_MODEL} has no config.json (it ships "
                                "with the repository under assets/model); restore it, or start with --model DIR")
    return EMBEDDED_MODEL, EMBEDDED_NOTICE


def parse_auth(value: str | None) -> tuple[str, str] | None:
    if not value:
        return None
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise argparse.ArgumentTypeError("--auth takes user:password")
    return user, password


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The page's, the API's and the replicas' flags, and the engine's (EngineConfig's): `args.engine` is the
    engine's configuration, `args.replica_options` the replicas' (with --replicas)."""
    from engine.serve.engine_config import SERVING_MAX_BATCH, EngineConfig
    ap = argparse.ArgumentParser(prog="python app.py", description="HunyuanImage-3.0 studio (Gradio web UI).")
    EngineConfig.add_arguments(ap.add_argument_group("engine", "the engine's options (engine/serve/engine_config.py)"))
    ap.set_defaults(max_batch=SERVING_MAX_BATCH)          # a server runs requests together (the one-shot CLI: 1)
    ap.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1, or $GRADIO_SERVER_NAME; "
                                                  "0.0.0.0 for every interface)")
    ap.add_argument("--port", type=int, default=None, help="port (default 7860, or $GRADIO_SERVER_PORT; the next "
                                                           "free one when taken)")
    ap.add_argument("--share", action="store_true", help="also open a temporary public *.gradio.live link")
    ap.add_argument("--auth", default=os.environ.get("STUDIO_AUTH"),
                    help="user:password required to open the page and use the API (default $STUDIO_AUTH)")
    ap.add_argument("--max-queue", type=int, default=8, help="requests that may wait in the queue (default 8)")
    ap.add_argument("--api-key", default=os.environ.get("STUDIO_API_KEY"),
                    help="key the OpenAI-compatible /v1 API requires as 'Authorization: Bearer KEY' "
                         "(default $STUDIO_API_KEY; none: /v1 is open, unless --auth is set). Without --auth the "
                         "page then asks for a login too: any user name, this key as the password")
    ap.add_argument("--step-timeout", type=float, default=None,
                    help="seconds a running request may go without a token or step before the engine is "
                         "restarted and the request failed (default: automatic, 20x the pace of the engine's "
                         "slowest recent request, between 10 and 120 s, 120 s for the first request after a start; "
                         "0: never)")
    ap.add_argument("--api-only", action="store_true", help="serve the /v1 API and /health without the page")
    ap.add_argument("--results-dir", default=None, metavar="DIR",
                    help="keep the page's finished images (its history, its links) in DIR for the next start "
                         "(default: a temporary folder that goes with the server; the last 500, 2 GB at most)")
    ap.add_argument("--max-upload-mb", type=float, default=20.0,
                    help="largest reference image file the API accepts, in MB (default 20)")
    ap.add_argument("--max-upload-pixels", type=int, default=None,
                    help="most pixels a reference image may declare, checked before decoding (default 4096x4096)")
    rep = ap.add_argument_group("replicas", "several engines behind this page and /v1, as Ray Serve replicas "
                                            "(README: Replicas); without --replicas Ray is not used")
    rep.add_argument("--replicas", type=int, default=None, help="number of engine replicas (the initial number "
                                                                "with --min/--max-replicas)")
    rep.add_argument("--gpus-per-replica", type=float, default=None,
                     help="GPUs (engine ranks) of each replica (default: --gpus, else the plan's, else 1); a "
                          "fraction such as 0.5 puts that many one-rank replicas on each GPU (a small model)")
    rep.add_argument("--ray-address", default=None, help="a running Ray cluster to place the replicas on "
                                                         "(default: start a local Ray on this machine)")
    rep.add_argument("--min-replicas", type=int, default=None, help="autoscale on queue depth from this many ...")
    rep.add_argument("--max-replicas", type=int, default=None, help="... to this many replicas")
    rep.add_argument("--upscale-delay", type=float, default=None, metavar="S",
                     help="seconds the queue stays above the target before a replica is added (default 30)")
    rep.add_argument("--downscale-delay", type=float, default=None, metavar="S",
                     help="seconds it stays below before one is removed (default 600)")
    args = ap.parse_args(argv)
    try:
        args.auth = parse_auth(args.auth)
        args.engine = EngineConfig.from_args(args)
        check_server_flags(args)
        args.replica_options = replica_options(args) if args.replicas is not None else None
    except (argparse.ArgumentTypeError, ValueError) as e:
        ap.error(str(e))
    return args


def check_server_flags(args: argparse.Namespace) -> None:
    """The page's, the API's and the replicas' flags (ValueError naming the one at fault)."""
    if args.max_queue < 1:
        raise ValueError("--max-queue must be at least 1")
    if args.step_timeout is not None and args.step_timeout < 0:
        raise ValueError("--step-timeout takes seconds >= 0 (0: never)")
    if args.max_upload_mb <= 0 or (args.max_upload_pixels is not None and args.max_upload_pixels < 1):
        raise ValueError("--max-upload-mb and --max-upload-pixels must be positive")
    if args.api_only and (args.share or args.results_dir):
        raise ValueError("--share and --results-dir are the page's; they do not go with --api-only")
    if args.replicas is not None and args.engine.lora_merged:
        raise ValueError("--lora-merged is not supported with --replicas yet (serve the adapter unmerged: "
                         "--lora NAME=PATH)")
    if args.replicas is None and any(v is not None for v in (args.gpus_per_replica, args.ray_address,
                                                             args.min_replicas, args.max_replicas,
                                                             args.upscale_delay, args.downscale_delay)):
        raise ValueError("--gpus-per-replica, --ray-address, --min-replicas, --max-replicas and the scaling delays "
                         "need --replicas N")
    if args.min_replicas is None and (args.upscale_delay, args.downscale_delay) != (None, None):
        raise ValueError("--upscale-delay and --downscale-delay need --min-replicas and --max-replicas (autoscaling)")
    if args.replicas is not None and args.world_size is not None and \
            args.gpus_per_replica not in (None, args.world_size):
        raise ValueError("--gpus and --gpus-per-replica differ; with --replicas give only --gpus-per-replica")


def replica_options(args: argparse.Namespace):
    """--replicas and its flags as the pool's options (checked there: ValueError names what is wrong)."""
    from engine.serve.replicas import ReplicaOptions        # imports no Ray
    delays = {k: v for k, v in (("upscale_delay_s", args.upscale_delay), ("downscale_delay_s", args.downscale_delay))
              if v is not None}
    return ReplicaOptions(replicas=args.replicas, gpus_per_replica=args.gpus_per_replica or args.world_size,
                          min_replicas=args.min_replicas, max_replicas=args.max_replicas, ray_address=args.ray_address,
                          **delays)


def engine_server(args: argparse.Namespace):
    """One EngineServer, or with --replicas a pool of them on Ray Serve with the same client API."""
    server_options = dict(max_queue=args.max_queue, step_timeout=args.step_timeout)
    if args.replicas is None:
        from engine.serve.server import EngineServer
        return EngineServer(args.engine, **server_options)
    from engine.serve.replicas import ReplicaPool
    return ReplicaPool(args.engine, args.replica_options, **server_options)


def key_login(key: str):
    """The page's login when only --api-key is set: any user name, the API key as the password. One
    secret then guards everything that can spend the GPU (the page's Gradio API generates on the same
    engine and queue as /v1), instead of a protected /v1 beside an open page."""
    def check(user: str, password: str) -> bool:
        return secrets.compare_digest(password.encode(), key.encode())
    return check


KEY_LOGIN_MESSAGE = "Log in with any user name and the server's API key (--api-key) as the password."


def page_login(args: argparse.Namespace):
    """What the page asks for: --auth's user and password, else the API key (key_login), else nothing."""
    if args.auth is not None:
        return args.auth
    if args.api_key:
        return key_login(args.api_key)
    return None


def access_notice(args: argparse.Namespace) -> str:
    """One line on what needs credentials, printed at start (and reported by /health as `auth`)."""
    api = "needs the API key" if args.api_key else ("closed (set --api-key)" if args.auth else "OPEN")
    if args.api_only:
        page = None
    elif args.auth is not None:
        page = "needs the --auth login"
    elif args.api_key:
        page = "needs a login: any user name, the API key as password"
    else:
        page = "OPEN"
    parts = [f"/v1 {api}"] + ([f"page and its API {page}"] if page else [])
    line = "access: " + "; ".join(parts)
    if "OPEN" in line:
        line += ("  <- anyone who can reach this port can generate; use --api-key (and --auth) on a shared "
                 "network or with --share")
    return line


def api_config(args: argparse.Namespace):
    from engine.serve.openai_api import ApiConfig
    from engine.serve.openai_params import UploadLimits
    limits = UploadLimits(max_bytes=int(args.max_upload_mb * 1024 * 1024),
                          **({"max_pixels": args.max_upload_pixels} if args.max_upload_pixels else {}))
    page = None if args.api_only else ("login" if page_login(args) is not None else "open")
    return ApiConfig(api_key=args.api_key or None, page_auth=args.auth is not None and not args.api_only,
                     limits=limits, page=page)


def run_api_only(server, args: argparse.Namespace) -> int:
    """`--api-only`: the /v1 API and /health on the engine server, without the page (nor Gradio)."""
    from engine.serve.openai_api import api_app, bind, serve
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    print(f"\napi: http://{host}:{port}/v1 (OpenAI-compatible; health: /health)", flush=True)
    try:
        serve(api_app(server, api_config(args)), sock)          # until Ctrl-C / SIGTERM
    except KeyboardInterrupt:
        pass
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")   # no calls home; works offline
    signal.signal(signal.SIGTERM, _interrupt)    # `docker stop`, systemd, Spaces: shut down like Ctrl-C
    from engine.checkpoint.config import ConfigError

    try:
        notice = None if args.model else default_model()[1]       # FileNotFoundError: a broken checkout
        server = engine_server(args)
    except (ConfigError, ValueError, OSError) as e:      # a wrong folder or device, a plan that does not fit
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.replicas is not None:      # again: Ray's start puts its own SIGTERM handler in, which ends the
        signal.signal(signal.SIGTERM, _interrupt)     # process at once and would leave its cluster running
    copies = f"{args.replicas} replicas of " if args.replicas is not None else ""
    print(f"engine: loading {server.model} on {copies}{server.device} (plan {server.plan}, {server.world_size} "
          "rank(s)) in the background; requests wait until it is ready", flush=True)
    print(access_notice(args), flush=True)
    if args.api_only:
        try:
            return run_api_only(server, args)
        finally:
            server.close()
    from engine.serve.openai_api import OpenAIApi
    from engine.serve.results import ResultStore
    from webui.studio import build_studio, launch
    try:
        results = ResultStore(args.results_dir)
    except OSError as e:
        print(f"error: --results-dir {args.results_dir}: {e.strerror or e}", file=sys.stderr)
        server.close()
        return 2
    try:
        demo = build_studio(server, server.info, notice=notice, results=results)
        api = OpenAIApi(server, api_config(args))
        _, url, share_url = launch(demo, host=args.host, port=args.port, share=args.share, auth=page_login(args),
                                   auth_message=KEY_LOGIN_MESSAGE if args.auth is None and args.api_key else None,
                                   prevent_thread_lock=True, quiet=True,      # Gradio's own hints name its code
                                   app_kwargs={"lifespan": api.lifespan()})
        # one clear line, whatever the engine is printing while it loads
        hint = f"  (local: {url})" if share_url else ("" if args.share else "  (--share adds a temporary public link)")
        print(f"\nstudio: open {share_url or url}{hint}\napi: {url.rstrip('/')}/v1 (OpenAI-compatible)", flush=True)
        demo.block_thread()                     # until Ctrl-C
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
