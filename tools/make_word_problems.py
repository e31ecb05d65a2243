#!/usr/bin/env python
"""Write GSM8K-format word problems of our own, offline: JSONL (``question``, ``answer`` with
its working and ``#### <number>``) and veRL's Parquet layout of the same problems.

    python tools/make_word_problems.py --out data/word-problems [--train 512] [--eval 64] [--seed 0]

Writes ``train.jsonl``, ``test.jsonl`` and, with pyarrow installed, ``train.parquet`` and
``test.parquet`` (``data_source``, ``prompt`` as one user message with veRL's GSM8K
instruction, ``ability``, ``reward_model.ground_truth``, ``extra_info``) — the files a GSM8K
job reads, so the real-model configs run before the real data is on disk.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

NAMES = ["Ada", "Bilal", "Chen", "Dara", "Emeka", "Freya", "Goran", "Hana", "Ines", "Jun"]
THINGS = ["apples", "stamps", "marbles", "books", "shells", "pencils", "cards", "coins"]
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def problem(rng: random.Random) -> dict[str, str]:
    """One two-step problem: buy some, then give or lose some (answers stay positive)."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    have, more = rng.randint(3, 60), rng.randint(2, 40)
    packs = rng.randint(2, 6)
    gone = rng.randint(1, have + more * packs - 1)
    total = have + more * packs
    question = (
        f"{name} has {have} {thing}. {name} buys {packs} packs of {more} {thing} each, then gives "
        f"away {gone} {thing}. How many {thing} does {name} have now?"
    )
    answer = (
        f"{name} buys {packs} * {more} = <<{packs}*{more}={packs * more}>>{packs * more} {thing}.\n"
        f"So {name} has {have} + {packs * more} = <<{have}+{packs * more}={total}>>{total} {thing}.\n"
        f"After giving away {gone}: {total} - {gone} = <<{total}-{gone}={total - gone}>>{total - gone}.\n"
        f"#### {total - gone}"
    )
    return {"question": question, "answer": answer}


def write_parquet(rows: list[dict[str, str]], path: Path, split: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [
        {
            "data_source": "word_problems",
            "prompt": [{"role": "user", "content": f"{r['question']} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": r["answer"].rsplit("#### ", 1)[1]},
            "extra_info": {"split": split, "index": i, "question": r["question"], "answer": r["answer"]},
        }
        for i, r in enumerate(rows)
    ]
    pq.write_table(pa.Table.from_pylist(records), path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--eval", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    splits = {
        "train": [problem(rng) for _ in range(args.train)],
        "test": [problem(rng) for _ in range(args.eval)],
    }
    for split, rows in splits.items():
        (args.out / f"{split}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8"
        )
        try:
            write_parquet(rows, args.out / f"{split}.parquet", split)
        except ModuleNotFoundError:
            print("pyarrow is not installed: JSONL only", file=sys.stderr)
    print(f"{args.out}: {args.train} training and {args.eval} held-out problems")
    return 0


if __name__ == "__main__":
    sys.exit(main())
