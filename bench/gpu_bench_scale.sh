#!/usr/bin/env bash
# make bench-scale's 1-device run on a GPU host whose image carries JAX and not TensorFlow (nor Keras): installs
# the wheels it lacks, carried in ${WHEELS:-.whl} (keras 3.15.1 and namex, optree, google-crc32c as
# requirements.lock pins them; fetched for the host's Python with `pip download --no-deps --only-binary=:all:`),
# offline into /tmp/site, then runs bench/bench_scale.py with the arguments given (default: batches of 65,536
# rows) and writes scale.json into ${OUT:-bench/results}.
#
#   bench/gpu_bench_scale.sh [bench_scale arguments]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
wheels=${WHEELS:-.whl}
python=${PYTHON:-python3}
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl
export PYTHONPATH="/tmp/site:$PWD" KERAS_BACKEND=jax PYTHONUNBUFFERED=1 BENCH_RESULTS="${OUT:-bench/results}" \
  BENCH_COMMAND="bench/gpu_bench_scale.sh $*"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
"$python" -c "import jax, keras, numpy; print('jax', jax.__version__, 'keras', keras.__version__, 'numpy', numpy.__version__, jax.devices())"
"$python" bench/bench_scale.py "$@"
