"""What holds the GPU memory at a step's peak: torch's allocator trace, replayed up to its highest point.

    with LivePeak() as lp:          # records every allocation with its Python stack
        work()
    lp.summary()                    # {"peak_bytes", "before_bytes", "groups": [{"where", "bytes", "count"}...]}

Each live block at the peak is named by the innermost frames of this repository on its stack (file:line
function, up to three), so that a group reads as "this line of the flow, called from there". Blocks that were
live before recording began are counted as `before_bytes`. Recording costs a stack walk per allocation: use it
on a short run (a few layers), never in a timed step.
"""
from __future__ import annotations

from collections import defaultdict

import torch

MAX_ENTRIES = 5_000_000
_OURS = ("/dsv4debug/", "/references/", "/kernels/", "/dsv4_kernels/", "/dsv4_references/", "/benchmarks/")


class LivePeak:
    def __init__(self, depth: int = 3, top: int = 30):
        self.depth, self.top = depth, top

    def __enter__(self):
        torch.cuda.synchronize()
        self.before = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        torch.cuda.memory._record_memory_history(enabled=None)
        return False

    def _where(self, frames) -> str:
        ours = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in frames
                if any(p in f["filename"] for p in _OURS)]
        return " < ".join(ours[:self.depth]) or "(no frame of ours)"

    def summary(self) -> dict:
        events = [e for e in self.trace if e["action"] in ("alloc", "free_completed")]
        total, best, at = 0, 0, -1
        for i, e in enumerate(events):          # pass 1: where the allocated total peaks
            total += e["size"] if e["action"] == "alloc" else -e["size"]
            if total > best:
                best, at = total, i
        live: dict[int, dict] = {}
        for e in events[:at + 1]:               # pass 2: the blocks live at that point
            if e["action"] == "alloc":
                live[e["addr"]] = e
            else:
                live.pop(e["addr"], None)
        groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for e in live.values():
            g = groups[self._where(e.get("frames", ()))]
            g[0] += e["size"]
            g[1] += 1
        rows = sorted(({"where": k, "bytes": v[0], "count": v[1]} for k, v in groups.items()),
                      key=lambda r: -r["bytes"])
        return {"before_bytes": self.before, "peak_bytes": self.before + best, "events": len(events),
                "trace_full": len(self.trace) >= MAX_ENTRIES, "groups": rows[:self.top]}


def print_summary(s: dict) -> None:
    print(f"live at the peak: {s['peak_bytes'] / 2**30:.2f} GiB ({s['before_bytes'] / 2**30:.2f} GiB before "
          f"recording; {s['events']} events{', TRACE FULL: early events lost' if s['trace_full'] else ''})")
    for r in s["groups"]:
        print(f"  {r['bytes'] / 2**20:10.1f} MiB {r['count']:6d}  {r['where']}")
