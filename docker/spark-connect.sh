#!/usr/bin/env bash
# Runs the Spark Connect server that ships in the pyspark wheel, in the foreground (--wait), so the
# container lives as long as the server. Jobs reach it at sc://<host>:15002; their Python UDFs
# (mapInArrow + the tfx-bsl encoder) run here, which is why this runs from the project image.
# Session time zone UTC, as in the local sessions spark_jobs/session.py builds (minute partitions are UTC).
# Reads list their named files on the driver, and compiled classes are kept for 2000 plans, as
# spark_jobs/session.py sets for the sessions it starts (minute runs: docs/spark.md).
# Extra arguments are passed to spark-submit (e.g. --conf spark.sql.shuffle.partitions=64).
set -euo pipefail

if [ -z "${SPARK_HOME:-}" ]; then
  SPARK_HOME="$(python -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')"
  export SPARK_HOME
fi
mkdir -p "${SPARK_LOG_DIR:-/tmp/spark/logs}" "${SPARK_PID_DIR:-/tmp/spark}"

exec "$SPARK_HOME/sbin/start-connect-server.sh" --wait \
  --master "${SPARK_MASTER:-local[*]}" \
  --driver-memory "${SPARK_DRIVER_MEMORY:-4g}" \
  --executor-memory "${SPARK_EXECUTOR_MEMORY:-4g}" \
  --name ctr-spark-connect \
  --conf spark.connect.grpc.binding.port=15002 \
  --conf spark.local.dir="${SPARK_LOCAL_DIR:-/tmp/spark/local}" \
  --conf spark.sql.session.timeZone=UTC \
  --conf spark.sql.sources.parallelPartitionDiscovery.threshold=100000 \
  --conf spark.sql.codegen.cache.maxEntries=2000 \
  "$@"
