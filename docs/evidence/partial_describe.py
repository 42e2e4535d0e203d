"""Issue 59's descriptive numbers (docs/evidence.md, not tested): per arm of the partial-rollout comparison, the mean
per step over its seeds' steps of the carried, resumed and dropped conversations, the staleness and the importance
weights' effective sample size, read from the run folders' metrics.jsonl (not kept in steps.csv.gz).

    python docs/evidence/partial_describe.py runs/partial_study/runs/stress
"""
import json
import pathlib
import sys

import numpy as np

KEYS = tuple(f"rollout/partial/{name}" for name in ("carried", "resumed", "dropped", "staleness_mean",
                                                    "stale_token_share")) + ("lld/is_ess",)


def main(setting_dir: pathlib.Path) -> None:
    for arm in sorted(path.name for path in setting_dir.iterdir()):
        seeds = sorted((setting_dir / arm).glob("seed_*"))
        values = {key: [] for key in KEYS}
        for seed in seeds:
            with open(seed / "metrics.jsonl") as f:
                for record in map(json.loads, f):
                    if record.get("step", 0) >= 1:  # step 0 is the evaluation before training
                        for key in KEYS:
                            if record.get(key) is not None:
                                values[key].append(record[key])
        cells = [f"{key} {np.mean(v):.3f} ({len(v)} steps)" if v else f"{key} -" for key, v in values.items()]
        print(f"{arm} ({len(seeds)} seeds): " + ", ".join(cells))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
