# Sourced by GPU scripts: installs the wheels carried in .whl (downloaded here by
# scripts/fetch_gpu_wheels.sh: transformers 5.25 and what it needs beyond the GPU image, gguf,
# llguidance, the server's packages) into /tmp/site and puts it first on PYTHONPATH. Without .whl
# the machine's own packages are used.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
