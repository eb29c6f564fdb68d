"""Render a run's TensorBoard scalars to a PNG (no TensorBoard server needed).

    python -m arlopti_jax.plot runs/default --out docs/results/default_run.png

Reads the event files under ``<run>/tb`` directly (TFRecord framing, tensorboardX's
protobufs) and draws a grid of the main curves with matplotlib.
"""

from __future__ import annotations

import argparse
import re
import struct
import sys
from collections import defaultdict
from pathlib import Path

# Each panel's curves: tags matching its patterns (full matches), in pattern order, then by name.
PANELS = [
    ("reward", ["reward/mean", r"reward/kk_logic\d+"]),
    ("train accuracy", ["acc/all", r"acc/kk_logic\d+"]),
    ("eval accuracy (greedy)", ["eval/avg/greedy_acc", r"eval/test_[^/]+/greedy_acc"]),
    ("response length", ["response/length_mean", "response/length_max"]),
    ("KL to reference", ["update/low/kl", "update/high/kl", "update/kl"]),
    ("entropy", ["update/low/entropy", "update/high/entropy", "update/entropy"]),
    ("grad norm", ["update/low/grad_norm", "update/high/grad_norm", "update/grad_norm"]),
    ("mean |A~| per pi_old quartile", [f"quartile/q{i}_mean_abs_adv" for i in range(1, 5)]),
    ("time per phase (s)", ["time/rollout", "time/update", "time/reward"]),
]


def read_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from every event file under run_dir/tb."""
    from tensorboardX.proto import event_pb2

    files = sorted(Path(run_dir).glob("tb/events.out.tfevents.*"))
    if not files:
        raise FileNotFoundError(f"{run_dir}/tb: no TensorBoard event files")
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for path in files:
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            record = data[pos + 12:pos + 12 + length]  # skip the length's CRC; the data's CRC follows
            pos += 12 + length + 4
            if len(record) < length:
                break  # a record cut short by a crash: the rest is unreadable
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    out[value.tag].append((event.step, value.simple_value))
    return {tag: sorted(points) for tag, points in out.items()}


def plot(run_dir: str | Path, out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scalars = read_scalars(run_dir)
    panels = [(title, [t for pattern in patterns for t in sorted(scalars) if re.fullmatch(pattern, t)])
              for title, patterns in PANELS]
    panels = [(title, tags) for title, tags in panels if tags]
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, (title, tags) in zip(axes.flat, panels):
        for tag in tags:
            steps, values = zip(*scalars[tag])
            ax.plot(steps, values, marker="o" if len(steps) < 6 else None, ms=3, lw=1.2, label=tag)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"arlopti_jax run: {Path(run_dir).name}", fontsize=12)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m arlopti_jax.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    try:
        path = plot(args.run_dir, args.out or Path(args.run_dir) / "curves.png")
    except (FileNotFoundError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
