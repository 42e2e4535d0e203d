#!/usr/bin/env bash
# The prepared GPU benchmark (train-step MFU, decode vs bandwidth roofline; bench/gpu.py --help): bench/gpu.sh [args]
cd "$(dirname "$0")/.." && exec python bench/gpu.py "$@"
