#!/usr/bin/env bash
# TRL in its own environment, so it never shares packages with flowc's.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m venv bench/.venv-trl
bench/.venv-trl/bin/pip install -q torch==2.13.0 trl==1.16.0 psutil
