"""Write the built-in arithmetic task in verl's and TRL's dataset layouts.

    python examples/data/make_fixtures.py      # writes examples/data/arith_{verl.parquet,trl.jsonl}

verl (parquet): ``prompt`` as chat messages, ``data_source``, ``ability``,
``reward_model: {"style": "rule", "ground_truth": …}``, ``extra_info: {"split", "index"}``.
TRL (jsonl): ``prompt`` as text and the extra ``answer`` column its reward
functions receive as a keyword. 256 training problems each (deterministic).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = 256


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flowc.tasks.arithmetic import split

    train, _ = split()
    probs = train[:ROWS]
    verl = [
        {
            "data_source": "flowc/arithmetic",
            "prompt": [{"role": "user", "content": p.prompt}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": p.answer},
            "extra_info": {"split": "train", "index": i},
        }
        for i, p in enumerate(probs)
    ]
    pq.write_table(pa.Table.from_pylist(verl), HERE / "arith_verl.parquet")
    with (HERE / "arith_trl.jsonl").open("w") as f:
        for p in probs:
            f.write(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n")
    print(f"wrote {HERE / 'arith_verl.parquet'} and {HERE / 'arith_trl.jsonl'} ({ROWS} rows each)")


if __name__ == "__main__":
    main()
