"""Where each request of a traced run waited: per request, the times (ms from the group's
first AddRequest) at which each stage received its input, scheduled it, and emitted output.

    OMNISTAGE_TRACE_DIR=/tmp/tr omnistage bench omni ...
    python scripts/trace_requests.py /tmp/tr c8-     # requests whose id starts with c8-
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def load(directory: str) -> tuple[list[dict], dict[tuple[int, int], str]]:
    events, names = [], {}
    source = Path(directory)
    for path in [source] if source.is_file() else sorted(source.glob("trace-*.json")):
        for ev in json.loads(path.read_text())["traceEvents"]:
            if ev["ph"] == "M":
                names[(ev["pid"], ev["tid"])] = ev["args"]["name"]
            else:
                events.append(ev)
    return events, names


def main(directory: str, prefix: str) -> None:
    events, names = load(directory)
    rows: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    busy: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for ev in events:
        who = names.get((ev["pid"], ev["tid"]), str(ev["pid"]))
        start, end = ev["ts"] / 1e3, (ev["ts"] + ev["dur"]) / 1e3      # ms
        a = ev["args"]
        busy[who].append((start, end, ev["name"]))
        rid = a.get("request")
        if rid is not None and rid.startswith(prefix):
            tag = ev["name"] if ev["name"] != "route" else f"route.{a['stage']}"
            rows[rid][f"{who}.{tag}"].append(end)
        for rid in a.get("outputs", []) or []:
            if rid.startswith(prefix):
                rows[rid][f"{who}.{ev['name']}.out"].append(end)
        for rid in (a.get("prefill") or {}):
            if rid.startswith(prefix):
                rows[rid][f"{who}.{ev['name']}.prefill"].append(end)
    if not rows:
        sys.exit(f"no request starting with {prefix!r}")
    t0 = min(min(v) for r in rows.values() for k, v in r.items() if k.endswith("AddRequest"))
    keys = sorted({k for r in rows.values() for k in r})
    for rid in sorted(rows, key=lambda r: int(r.rsplit("-", 1)[-1])):
        print(f"== {rid}")
        for k in keys:
            v = sorted(rows[rid].get(k, []))
            if v:
                shown = ", ".join(f"{x - t0:.1f}" for x in v[:4])
                print(f"   {k:40s} n={len(v):4d} first: {shown}")
    # what each thread did in the first second after t0
    print("== busy in 100 ms windows after t0 (ms of spans per window)")
    for who, spans in sorted(busy.items()):
        by_name: dict[str, list[float]] = defaultdict(lambda: [0.0] * 10)
        for s, e, name in spans:
            for w in range(10):
                lo, hi = t0 + 100 * w, t0 + 100 * (w + 1)
                by_name[name][w] += max(0.0, min(e, hi) - max(s, lo))
        for name, ws in sorted(by_name.items()):
            if sum(ws) > 0.5:
                print(f"   {who:10s} {name:22s} " + " ".join(f"{x:5.1f}" for x in ws))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
