#!/usr/bin/env bash
# The dependency floors of pyproject.toml, tested (`make check-floors`; docs/development.md).
#
# Every requirement `NAME>=X` of the core dependencies and of the extras (serve, train,
# eval, docs, test) becomes the constraint `NAME==X`; a scratch venv installs jaxkv with
# the extras serve, train and eval, the suite's tools and torch (tests/conftest.py builds
# its reference models with it) under those constraints, so each package named in
# pyproject.toml is at its floor and the rest resolves around them. Then the fast tests
# run on it. A floor the code does not run on fails here: raise it in pyproject.toml.
#
#   FLOORS_VENV   the scratch venv (default /tmp/jaxkv-floors; made anew each run)
#   FLOORS_TESTS  the tests to run (default below: every layer once, no slow test)
#   PYTHON        the interpreter of the venv (default python3.11)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VENV=${FLOORS_VENV:-/tmp/jaxkv-floors}
# One test file per layer that the floors touch: jax (attention, ragged kernels in
# interpret mode, sharding with jax.set_mesh / shard_map), flax and the HF loaders, the
# scheduler, the chat templates (transformers, jinja2), the server (fastapi, uvicorn,
# prometheus_client, openai, httpx), the trainer (optax, orbax), segment reuse
# (datasketch) and the layering contracts (import-linter).
TESTS=${FLOORS_TESTS:-"tests/test_attention.py tests/test_ragged_attention.py tests/test_sharding.py \
tests/test_loading.py tests/test_chat_render.py tests/test_scheduler.py tests/test_server_http.py \
tests/test_server_metrics.py tests/test_train_embedded.py tests/test_reuse.py tests/test_layering.py"}

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$PYTHON" - > "$VENV/floors.txt" <<'EOF'
import re, tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
requirements = list(project["dependencies"])
for extra in ("serve", "train", "eval", "docs", "test"):
    requirements += project["optional-dependencies"][extra]
floors = {}
for req in requirements:
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?\s*(>=|==)\s*([0-9][^,;\s]*)", req.strip())
    if m and m[1] != "jaxkv":
        floors[m[1].lower().replace("_", "-")] = m[4]
print("\n".join(f"{name}=={version}" for name, version in sorted(floors.items())))
EOF
echo "floors ($VENV/floors.txt):"
sed 's/^/  /' "$VENV/floors.txt"

PIP=("$VENV/bin/python" -m pip install -q --no-compile -c "$VENV/floors.txt")
"${PIP[@]}" -e ".[serve,train,eval]" pytest hypothesis import-linter torch accelerate
"$VENV/bin/python" -m pip check

echo "installed:"
"$VENV/bin/python" -m pip list --format=freeze 2>/dev/null \
  | grep -iE "^(jax|jaxlib|flax|numpy|transformers|tokenizers|safetensors|huggingface.hub|tqdm|jinja2|datasketch|gguf|fastapi|uvicorn|prometheus.client|optax|orbax.checkpoint|matplotlib|scipy|httpx|openai|pytest|hypothesis|import.linter|torch|accelerate)==" \
  | sed 's/^/  /'

# shellcheck disable=SC2086
JAX_PLATFORMS=cpu "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" $TESTS
