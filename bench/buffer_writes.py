"""What durability costs per record: ``ReplayBuffer.add`` of records shaped like the default
draft's (48 verified rows, the target's top-32 and its 576-wide fp16 features), on this disk.

Each record's answer waits for its write (an answer is an acknowledgement), so this is added
to every request's latency on the recorder thread. ``--src`` runs the same measurement against
another checkout's ``src`` (an earlier commit) in a child process, beside this one.

    python bench/buffer_writes.py [--n 300] [--src /path/to/old/src]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

MEASURE = """
import json, statistics, sys, tempfile, time, torch
from onlinespec.distill.records import DistillRecord
from onlinespec.online.buffer import ReplayBuffer
n = int(sys.argv[1])
gen = torch.Generator().manual_seed(0)
def record(i):
    rows, tokens = 48, 160
    return DistillRecord(list(range(tokens)), list(range(tokens - rows, tokens)), torch.randint(0, 49152, (rows, 32), generator=gen),
                         torch.randn(rows, 32, generator=gen), 112, "code", f"r{i}",
                         torch.randn(rows, 576, generator=gen).half(), [False] * rows)
records = [record(i) for i in range(n)]
buffer = ReplayBuffer(tempfile.mkdtemp(dir=sys.argv[2]), "window", max_records=10 * n)
seconds = []
for r in records:
    tick = time.perf_counter()
    buffer.add(r)
    seconds.append(time.perf_counter() - tick)
seconds.sort()
print(json.dumps({"median_ms": statistics.median(seconds) * 1e3, "p90_ms": seconds[int(0.9 * n)] * 1e3,
                  "bytes": buffer.nbytes // n}))
"""


def measure(src: str | None, n: int, folder: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"PYTHONPATH": src} if src else {})}
    out = subprocess.run([sys.executable, "-c", MEASURE, str(n), folder], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--src", help="another checkout's src folder, measured beside this one")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(dir=os.getcwd(), prefix=".bench-buffer-")  # on the disk a run's --out-dir would be on
    runs: dict[str, list[dict]] = {"this checkout": [], f"--src {args.src}": []}
    for _ in range(args.rounds):
        runs["this checkout"].append(measure(None, args.n, folder))
        if args.src:
            runs[f"--src {args.src}"].append(measure(args.src, args.n, folder))
    for name, results in runs.items():
        if results:
            median = statistics.median(r["median_ms"] for r in results)
            p90 = statistics.median(r["p90_ms"] for r in results)
            print(f"{name}: {args.n} records of {results[0]['bytes'] / 1024:.0f} KiB, median add {median:.2f} ms "
                  f"(p90 {p90:.2f} ms), medians of {len(results)} runs")
    subprocess.run(["rm", "-rf", folder], check=False)


if __name__ == "__main__":
    main()
