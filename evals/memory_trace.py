"""What holds GPU memory at the peak of a window: torch's allocation trace, replayed.

Device-wide peaks say how much, not what. Inside a window (one GRPO step's generation, say) torch's allocator
records every allocation, free and cudaMalloc with the Python stack that made it
(`torch.cuda.memory._record_memory_history`); replaying that trace finds the moment the window's own allocations
peaked and which lines held the memory then, and likewise for the segments torch reserved from the driver (what
`nvidia-smi` sees). Allocations made before the window are the baseline: freeing one of them during the window
counts as negative. The replay is plain Python over the trace's dicts, so it is tested on the CPU with a trace
written by hand in torch's format (`torch.cuda.memory._snapshot()["device_traces"]`).
"""

from __future__ import annotations

from collections import defaultdict

# where a user frame starts: our code, the engine and the model library; torch's own frames are skipped, but code
# Inductor generated is where compiled graphs allocate, so it counts as a site (under /tmp/torchinductor_<user>, or
# vLLM's cache: ~/.cache/vllm/torch_compile_cache/.../inductor_cache)
OWNERS = ("fp8kit/", "vllm/", "transformers/", "evals/")
GENERATED = ("torchinductor", "inductor_cache")


def _generated(frame: dict) -> bool:
    return any(g in frame["filename"] for g in GENERATED)


def _short(frame: dict) -> str:
    path = frame["filename"]
    if _generated(frame):
        path = "inductor:" + path.rsplit("/", 1)[-1]
    else:
        for marker in ("site-packages/", "gpu-site/", "fp8kit/", "evals/"):
            if marker in path:
                rest = path.split(marker, 1)[1]
                path = rest if marker in ("site-packages/", "gpu-site/") else marker + rest
                break
    return f"{path}:{frame['line']} {frame['name']}"


def site(frames: list[dict]) -> str:
    """The allocating line (innermost frame outside torch's own package; torch traces list the innermost frame
    first) and, when it is elsewhere, the innermost frame of our code, vLLM or transformers that led to it."""
    def in_torch(f):
        return "/torch/" in f["filename"] and not _generated(f)

    inner = next((f for f in frames if not in_torch(f)), frames[0] if frames else None)
    if inner is None:
        return "unknown (no stack recorded)"
    owner = next((f for f in frames if f is not inner and not _generated(f)
                  and any(o in f["filename"] for o in OWNERS)), None)
    if owner is None:
        return _short(inner)
    return f"{_short(owner)} <- {_short(inner)}"


def _replay(trace: list[dict], grow: str, shrink: str):
    """Running total of the window's bytes for one pair of actions; yields (index, total) after each event."""
    total = 0
    for i, event in enumerate(trace):
        if event["action"] == grow:
            total += event["size"]
        elif event["action"] == shrink:
            total -= event["size"]
        yield i, total


def live_at_peak(trace: list[dict], kind: str = "allocated", top: int = 12) -> dict:
    """kind "allocated" (tensors: alloc / free_completed) or "reserved" (segments: segment_alloc / segment_free).
    Returns the peak of the window's own bytes above its start and the sites holding them then, largest first."""
    grow, shrink = {"allocated": ("alloc", "free_completed"), "reserved": ("segment_alloc", "segment_free")}[kind]
    peak, at = 0, -1
    for i, total in _replay(trace, grow, shrink):
        if total > peak:
            peak, at = total, i
    live: dict[int, dict] = {}
    for event in trace[:at + 1]:
        if event["action"] == grow:
            live[event["addr"]] = event
        elif event["action"] == shrink:
            live.pop(event["addr"], None)
    by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for event in live.values():
        entry = by_site[site(event.get("frames") or [])]
        entry[0] += event["size"]
        entry[1] += 1
    sites = sorted(by_site.items(), key=lambda kv: -kv[1][0])
    return {"peak_bytes_above_start": peak, "events_to_peak": at + 1, "events": len(trace),
            "live_bytes_at_peak": sum(e["size"] for e in live.values()),
            "sites": [{"site": s, "bytes": b, "count": n} for s, (b, n) in sites[:top]],
            "other_sites_bytes": sum(b for _, (b, _) in sites[top:])}


class Window:
    """Record torch's allocation trace from enter to exit on the current CUDA device and keep the replayed
    summaries (`.summary`). Recording costs time (a Python stack per allocation): time nothing inside one."""

    def __init__(self, max_entries: int = 2_000_000, top: int = 12):
        self.max_entries, self.top, self.summary = max_entries, top, None

    def __enter__(self):
        import torch

        torch.cuda.synchronize()
        try:  # a trace left by an earlier window must not count in this one
            torch.cuda.memory._record_memory_history(max_entries=self.max_entries, stacks="python", clear_history=True)
        except TypeError:  # torch without clear_history starts an empty trace when recording was off
            torch.cuda.memory._record_memory_history(max_entries=self.max_entries, stacks="python")
        return self

    def __exit__(self, *exc):
        import torch

        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snapshot["device_traces"][torch.cuda.current_device()]
        self.summary = {kind: live_at_peak(trace, kind, self.top) for kind in ("allocated", "reserved")}
        self.summary["wrapped"] = len(trace) >= self.max_entries  # the ring buffer dropped the earliest events
