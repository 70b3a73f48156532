"""A ShardClient's requests in a row to its agent killed, in a process of its own (a send that
blocks for ever must not take the pytest process with it):

    python -m tests.helpers.dead_agent_job CACHE_DIR URL CALLS TIMEOUT

Opens (pins) ``URL`` and prints ``pinned``; at a line on stdin (the agent killed meanwhile), asks
for stats ``CALLS`` times with ``timeout=TIMEOUT`` and prints a JSON line: how many calls raised
which error, and the longest a call took. At a second line on stdin (the agent started again),
asks for stats once more (the client takes its pin again at the new run first) and prints them
as a JSON line; then closes the client.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter

from wdscache import ShardClient, WdsCacheError


def main() -> None:
    cache, url, calls, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    with ShardClient(cache, timeout=30) as client:
        client.open(url)
        print("pinned", flush=True)
        sys.stdin.readline()
        raised: Counter[str] = Counter()
        longest = 0.0
        for _ in range(calls):
            started = time.monotonic()
            try:
                client.stats(timeout=timeout)
                raised["none"] += 1
            except WdsCacheError as exc:
                raised[type(exc).__name__] += 1
            longest = max(longest, time.monotonic() - started)
        print(json.dumps({"raised": raised, "longest": longest}), flush=True)
        sys.stdin.readline()
        print(json.dumps(client.stats(timeout=30)), flush=True)


if __name__ == "__main__":
    main()
