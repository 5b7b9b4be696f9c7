#!/usr/bin/env bash
# Build .whl/: the packages a GPU machine without a package registry needs beyond its own CUDA
# image (torch, triton, numpy, ... already there), for CPython 3.12 on x86-64 Linux.
# Run on a machine that reaches PyPI; carry .whl/ to the GPU machine and install as
# .whl/USAGE.txt says. Ray's wheel is slimmed (no jars, rllib, serve, data, llm, dashboard
# source maps) and packed with xz to stay small. `dflash-dist regenerate`'s client (openai and what only it
# needs) goes to .whl-regen/ beside it: a device call carries at most 64 MiB counted in disk blocks, and the
# checkout (~13.5 MiB) with .whl/ and Ray's tarball leaves ~1.7 MiB; carry .whl-regen/ only where regenerate
# runs against a local server.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.whl
mkdir -p "$out"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform any)
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$out" "$@"; }

# the project's own pins (setup.py) that the image lacks or holds at another version
get transformers==5.24.0 flash-linear-attention==0.6.0 fla-core==0.6.0 webdataset==1.0.2 \
    liger-kernel==0.8.5 xxhash==4.1.0
# their needs, at the versions a CPU install of this project resolves (pip freeze); tokenizers and
# huggingface-hub come from the image (0.23.2 / 1.33 satisfy transformers 5.24)
get braceexpand==0.1.7 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-extensions==4.16.0 typing-inspection==0.4.5 jsonschema==4.26.0 referencing==0.37.0 \
    jsonschema-specifications==2025.9.1 rpds-py==2026.9.1 \
    anyio==4.16.0 httpx2==2.16.2 httpcore2==2.16.2 truststore \
    hjson==3.1.0
# openai (regenerate's client) and the two packages only it needs, out of .whl/ (where earlier builds put them)
rm -f "$out"/openai-*.whl "$out"/jiter-*.whl "$out"/sniffio-*.whl
mkdir -p .whl-regen
get -d .whl-regen openai==3.57.0 jiter==0.19.0 sniffio==1.3.1
# deepspeed is a source package: a wheel without its compiled ops (JIT where needed)
if ! ls "$out"/deepspeed-0.19.8-*.whl >/dev/null 2>&1; then
    # (built in an isolated env: a bare python3 has no `wheel` for setup.py bdist_wheel)
    DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w "$out" deepspeed==0.19.8
fi
# ray: unpack, drop what a trainer never imports, pack with xz
if [ ! -f "$out/ray-2.60.0-cp312-slim.tar.xz" ]; then
    tmp=$(mktemp -d)
    get -d "$tmp" ray==2.60.0
    (cd "$tmp" && unzip -q ray-2.60.0-*.whl -d site \
        && rm -rf site/ray/jars site/ray/rllib site/ray/serve site/ray/data site/ray/llm \
        && find site -name '*.js.map' -delete \
        && tar -C site -cf - . | xz -6 -T2 > ray-2.60.0-cp312-slim.tar.xz)
    mv "$tmp/ray-2.60.0-cp312-slim.tar.xz" "$out/"
    rm -rf "$tmp"
fi
cat > "$out/USAGE.txt" <<'EOF'
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  $(ls .whl-regen/*.whl 2>/dev/null) \
  && mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl/ray-2.60.0-cp312-slim.tar.xz \
  && chmod +x /tmp/site/ray/core/src/ray/raylet/raylet /tmp/site/ray/core/src/ray/gcs/gcs_server 2>/dev/null; \
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
EOF
touch "$out/READY"
du -sh "$out" .whl-regen
