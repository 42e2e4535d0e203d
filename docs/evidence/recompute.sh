#!/bin/sh
# Recomputes every table of docs/evidence.md from the records committed under docs/evidence/ (runs.csv and,
# where the study kept them, per-step metrics in steps.csv.gz), without a run folder: the 96-run study of
# 2026-12-02, its gate ablation on seeds 0-3 alone, the calibration of the collapse regime and the 48-run collapse
# study of issue 33. Each report goes to its own folder under OUT (default /tmp/llds_jax_evidence); the .md files
# there are the committed ones byte for byte, and every table row of docs/evidence.md is a row of one of them
# (tests/test_demo_study.py checks both). Run from the repository root: sh docs/evidence/recompute.sh [OUT]
set -eu
OUT=${1:-/tmp/llds_jax_evidence}
EVIDENCE=docs/evidence
STUDY_ARMS=grpo,llds,llds_low_lr,grpo_low_lr,grpo_clip_higher,grpo_tis

python -m llds_jax.apps.demo_study --settings stress,default,paper_shaped --seeds 8 \
    --arms grpo,llds,grpo_low_lr:4,grpo_kl10:4,llds_token:4,llds_response:4 --out "$OUT/study_2026_12_02" \
    --report --recorded "$EVIDENCE/runs.csv"
python -m llds_jax.apps.demo_study --settings stress,default,paper_shaped --seeds 4 \
    --arms grpo,llds,llds_token,llds_response --out "$OUT/gates_seeds_0_3" --controls grpo \
    --report --recorded "$EVIDENCE/runs.csv"
python -m llds_jax.apps.demo_study --settings lr1e3=configs/demo_cpu_grpo.py --seeds 0-1 --arms grpo \
    --out "$OUT/collapse_calibration" --report --recorded "$EVIDENCE/collapse/calibration/runs.csv" \
    -- --config.optim.learning_rate=1e-3 --config.train.total_steps=40
python -m llds_jax.apps.demo_study --settings collapse --seeds 2-9 --arms "$STUDY_ARMS" \
    --out "$OUT/collapse_study" --report --recorded "$EVIDENCE/collapse/study/runs.csv" \
    --controls grpo --endpoints collapsed,final_em,lld_rate_mean
