#!/bin/sh
# The GPU check (see gpu_check.py): build, GPU tests, benchmarks; table last.
cd "$(dirname "$0")/.." && exec python3 benchmarks/gpu_check.py "$@"
