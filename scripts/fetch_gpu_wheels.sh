#!/usr/bin/env bash
# Run HERE (not on the GPU machine): downloads into .whl the wheels the GPU scripts install with
# scripts/gpu_wheels.sh (transformers 5.25 and what it needs beyond the GPU image's packages,
# gguf, llguidance, the server's packages), for CPython 3.12 on x86-64 Linux. .whl is git-ignored
# (echo /.whl/ >> .git/info/exclude); carry it with the device tool (carry: [".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
WHEELS=(
  transformers==5.25.0 tokenizers==0.23.3 huggingface_hub==2.4.0 hf_xet==1.8.0
  httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 h11==0.16.0 anyio==4.16.0 idna==3.21
  click==8.5.1 typer==0.29.2 regex==2026.12.2 kernels==0.19.1 tomlkit==0.15.3 gguf==0.19.0
  llguidance==1.9.1 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4
  pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5
)
PLATFORMS=()
for p in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
for w in "${WHEELS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d .whl "$w" 2>&1 | grep -v "^WARNING: Location" || true
done
ls .whl
du -sh .whl
