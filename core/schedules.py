"""Pipeline schedules: the order each stage runs its micro-batches in, a timeline from that order, and the bubble.

Three schedules, as Paddle 2.6.2's eager pipeline engines run them (paddle/distributed/fleet/meta_parallel/
pipeline_parallel.py):
- `1F1B` (`PipelineParallel`): stage s runs p-s-1 warm-up forwards, then one forward / one backward, then the
  remaining backwards. Bubble (p-1)/(m+p-1) of the step, with at most p-s micro-batches' activations in flight.
- `interleaved-1F1B` (`PipelineParallelWithInterleave`): every device holds v model chunks (virtual stages); the
  same 1F1B pattern over v*m chunk steps, warm-up 2(p-s-1) + (v-1)p. Bubble (p-1)/(v*m+p-1).
- `FThenB` (`PipelineParallelWithInterleaveFthenB`, Paddle's only F-then-B engine, interleaved): every forward, then
  every backward (GPipe). Same bubble as interleaved, but all m*v micro-batches' activations live at once.

`stage_order` writes the orders; `parse_paddle_order` reads the string Paddle's own engine prints with
`get_static_scheduler()` (`f0;b0;` / `f0_vp1;`) into the same form, so a run's timeline is drawn from Paddle's order.
`simulate` places the ops in time (a forward needs the previous virtual stage's forward of that micro-batch, a
backward the next virtual stage's backward), with unit or measured times. No paddle import: dry runs use this.
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("1F1B", "interleaved-1F1B", "FThenB")


@dataclass(frozen=True)
class Op:
    kind: str  # "f" | "b"
    micro: int
    chunk: int = 0


@dataclass(frozen=True)
class Event:
    stage: int
    op: Op
    start: float
    end: float


def analytic_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a step with equal stages and free communication."""
    if p <= 1:
        return 0.0
    chunks = v if schedule in ("interleaved-1F1B", "FThenB") else 1
    return (p - 1) / (chunks * m + p - 1)


def stage_order(schedule: str, p: int, m: int, v: int, stage: int) -> list[Op]:
    if schedule == "1F1B":
        warmup = min(p - stage - 1, m)
        steady = m - warmup
        ops = [Op("f", i) for i in range(warmup)]
        for i in range(steady):
            ops += [Op("f", warmup + i), Op("b", i)]
        return ops + [Op("b", steady + i) for i in range(warmup)]
    steps = m * v
    if schedule == "interleaved-1F1B":
        def chunk(step: int, forward: bool) -> int:
            c = (step % (p * v)) // p
            return c if forward else v - 1 - c
        warmup = min(2 * (p - stage - 1) + (v - 1) * p, steps)
        kinds = ["f"] * warmup
        for _ in range(steps - warmup):
            kinds += ["f", "b"]
        kinds += ["b"] * warmup
    elif schedule == "FThenB":
        def chunk(step: int, forward: bool) -> int:
            c = (step % (m * v)) // m
            return c if forward else v - 1 - c
        kinds = ["f"] * steps + ["b"] * steps
    else:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    # Micro-batch ids count per chunk, as Paddle's forward/backward micro-step counters do.
    counters = {("f", c): 0 for c in range(v)} | {("b", c): 0 for c in range(v)}
    steps_done = {"f": 0, "b": 0}
    ops = []
    for kind in kinds:
        c = chunk(steps_done[kind], kind == "f")
        steps_done[kind] += 1
        ops.append(Op(kind, counters[(kind, c)], c))
        counters[(kind, c)] += 1
    return ops


def parse_paddle_order(text: str) -> list[Op]:
    """`f0;f1;b0;` (PipelineParallel) or `f0_vp0;b0_vp1;` (interleaved) -> ops."""
    ops = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        head, _, vp = item.partition("_vp")
        ops.append(Op(head[0], int(head[1:]), int(vp or 0)))
    return ops


def simulate(orders: list[list[Op]], v: int, forward_time=None, backward_time=None) -> list[Event]:
    """Place every stage's ops in time. forward_time / backward_time: per stage (a list), default 1 and 2."""
    p = len(orders)
    tf = forward_time or [1.0] * p
    tb = backward_time or [2.0] * p
    last = p * v - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro, virtual stage) -> end time
    free = [0.0] * p
    position = [0] * p
    events: list[Event] = []
    while any(position[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if position[s] >= len(orders[s]):
                continue
            op = orders[s][position[s]]
            g = op.chunk * p + s
            if op.kind == "f":
                dep = ("f", op.micro, g - 1) if g > 0 else None
                length = tf[s] / v
            else:
                dep = ("b", op.micro, g + 1) if g < last else ("f", op.micro, g)
                length = tb[s] / v
            if dep is not None and dep not in done:
                continue
            start = max(free[s], done.get(dep, 0.0) if dep else 0.0)
            free[s] = done[(op.kind, op.micro, g)] = start + length
            events.append(Event(s, op, start, start + length))
            position[s] += 1
            progressed = True
        if not progressed:
            raise ValueError("the stage orders deadlock: " + "; ".join(
                f"stage {s} waits at {orders[s][position[s]]}" for s in range(p) if position[s] < len(orders[s])))
    return events


def idle_fraction(events: list[Event]) -> float:
    stages = {e.stage for e in events}
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1.0 - busy / (len(stages) * span)


def timeline(schedule: str, p: int, m: int, v: int = 1) -> list[Event]:
    return simulate([stage_order(schedule, p, m, v, s) for s in range(p)], v if schedule != "1F1B" else 1)


def render_text(events: list[Event], width: int = 100, max_order: int = 48) -> str:
    """One row per stage, one character per time slot of the shortest op: F/B (chunk 0) f/b (other chunks), '.'
    idle; a timeline wider than `width` shows its start and end (the fill and the drain, where the bubble is) around
    ' ~ '. Then each stage's order, when it has at most `max_order` ops."""
    span = max(e.end for e in events)
    stages = sorted({e.stage for e in events})
    step = min(e.end - e.start for e in events)
    rows = []
    for s in stages:
        cells = ["."] * int(round(span / step))
        order = []
        for e in (e for e in events if e.stage == s):
            char = e.op.kind.upper() if e.op.chunk == 0 else e.op.kind
            for i in range(int(round(e.start / step)), int(round(e.end / step))):
                cells[min(i, len(cells) - 1)] = char
            order.append(f"{e.op.kind.upper()}{e.op.micro}" + (f".{e.op.chunk}" if e.op.chunk else ""))
        text = "".join(cells)
        if len(text) > width:
            text = text[:width // 2] + " ~ " + text[-(width // 2):]
        rows.append(f"stage {s:2d} |{text}|")
        if len(order) <= max_order:
            rows.append(f"         order: {' '.join(order)}")
    return "\n".join(rows)


def compare_text(p: int, m: int, v: int) -> str:
    """The bubble of every schedule for this p and m (v virtual stages for the interleaved ones), side by side."""
    lines = ["schedule            virtual  analytic bubble  simulated idle  peak activations held (stage 0, micro-batches)"]
    for name in SCHEDULES:
        vv = 1 if name == "1F1B" else max(v, 2)
        events = timeline(name, p, m, vv)
        held = _max_in_flight([e for e in events if e.stage == 0]) / vv  # a chunk holds 1/v of a stage's layers
        lines.append(f"{name:<19} {vv:>7}  {analytic_bubble(name, p, m, vv):>15.3f}  {idle_fraction(events):>14.3f}"
                     f"  {held:>7.1f}")
    return "\n".join(lines)


def _max_in_flight(stage_events: list[Event]) -> int:
    live = peak = 0
    for e in sorted(stage_events, key=lambda e: e.start):
        live += 1 if e.op.kind == "f" else -1
        peak = max(peak, live)
    return peak


def render_png(events: list[Event], path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = sorted({e.stage for e in events})
    fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * len(stages)))
    colours = {("f", 0): "#4c72b0", ("f", 1): "#8fb0e0", ("b", 0): "#dd8452", ("b", 1): "#f0b88a"}
    for e in events:
        colour = colours[(e.op.kind, min(e.op.chunk, 1) if e.op.chunk % 2 else 0)]
        ax.broken_barh([(e.start, e.end - e.start)], (e.stage - 0.4, 0.8), facecolors=colour, edgecolor="white")
        label = f"{e.op.kind.upper()}{e.op.micro}" + (f".{e.op.chunk}" if e.op.chunk else "")
        ax.text((e.start + e.end) / 2, e.stage, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(stages, [f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
