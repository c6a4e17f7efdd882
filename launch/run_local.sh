#!/usr/bin/env bash
# Train on this machine: the run starts a local Ray cluster and stops it at the end.
#   launch/run_local.sh                                    # experiment=quickstart
#   launch/run_local.sh experiment=smoke                    # any Hydra overrides instead
#   launch/run_local.sh experiment=quickstart total_steps=20 cluster.cpus_per_learner=4
set -euo pipefail
cd "$(dirname "$0")/.."
python=".venv/bin/python"
[ -x "$python" ] || python="python"
[ "$#" -gt 0 ] || set -- experiment=quickstart
exec "$python" -m specroll.train "$@"
