#!/usr/bin/env bash
# The real-run scaling-law check of docs/scaling.md: an IsoFLOP grid of five gpt_tiny-family sizes trained on
# the built-in corpus (one process per size, one after another), a fit of L(N, D) = E + A/N^α + B/D^β on all
# sizes but the largest, and the largest's final eval loss predicted and compared with its measured one.
#
#   bash bench/scaling_fit.sh [WORK_DIR] [FLOPS]     (FLOPS per run, default 1e12: ≈ 10 min of training on 2 CPU cores)
# Relaunching resumes the sweep (finished runs are skipped). Writes WORK_DIR/fit.txt, fit.json and fit.png.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-/tmp/scaling_fit}
FLOPS=${2:-1e12}
[ -f data/pystdlib/prepared/manifest.json ] || python data/pystdlib/prepare.py
mkdir -p "$W"
# `scaling sweep` prints the grid (a table), a blank line, then the sweep command: run that command.
python -m t5x_like.scaling sweep --flops="$FLOPS" --output_dir="$W/runs" > "$W/grid.txt"
cat "$W/grid.txt"
sed '1,/^$/d' "$W/grid.txt" > "$W/sweep_command.sh"
bash "$W/sweep_command.sh"
# The largest model (d_model 128, 4 layers) is held out: the fit sees the four smaller sizes only.
python -m t5x_like.scaling fit --runs="$W/runs/d_model-*" --holdout="$W/runs/d_model-128__*" \
  --flops="$FLOPS" --bootstrap=20 --plot="$W/fit.png" --save="$W/fit.json" | tee "$W/fit.txt"
