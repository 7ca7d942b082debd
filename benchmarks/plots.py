"""The benchmark's PNG plots."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def lines(ax, series: dict[str, list[dict]], x: str, y: Callable[[dict], float], title: str, ylabel: str,
          xlabel: str = "tokens", **style) -> None:
  """One line per entry of `series` (name -> points) on log-log axes `ax`: point[x] against y(point), with
  matplotlib's `style` (e.g. linestyle)."""
  for name, points in series.items():
    ax.plot([p[x] for p in points], [y(p) for p in points], marker="o", label=name, **style)
  ax.set(xscale="log", yscale="log", title=title, xlabel=xlabel, ylabel=ylabel)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)


def plot(results, out: Path) -> list[str]:
  """PNG plots: time and memory vs length, latency and state vs context, training throughput."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  files = []
  for kind in ("forward", "train"):
    sweep = results["lengths"][kind]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    lines(axes[0], sweep, "seq_len", lambda p: p["seconds"]["median"], f"{kind}: time (batch 1)", "seconds")
    lines(axes[1], sweep, "seq_len", lambda p: max(p["memory"]["above_start_bytes"], 2**20) / 2**30,
          f"{kind}: peak memory above the start", "GiB")
    lines(axes[2], {k: v for k, v in sweep.items() if all(p["compiled_bytes"] for p in v)}, "seq_len",
          lambda p: p["compiled_bytes"] / 2**30, f"{kind}: XLA buffers", "GiB")
    files.append(f"{kind}_vs_length.png")
    fig.tight_layout()
    fig.savefig(out / files[-1], dpi=100)
    plt.close(fig)

  latency = results["decoding"]["latency"]
  fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
  lines(axes[0], latency, "context", lambda p: p["latency_s"]["median"] * 1e3, "decoding latency (batch 1)",
        "ms / token", "context tokens")
  lines(axes[1], latency, "context", lambda p: p["state_bytes"] / 2**20, "decoding state (KV cache)", "MiB",
        "context tokens")
  files.append("decoding_vs_context.png")
  fig.tight_layout()
  fig.savefig(out / files[-1], dpi=100)
  plt.close(fig)

  training = results["training"]
  fig, ax = plt.subplots(figsize=(10, 4.5))
  ax.barh(list(training), [r["tokens_per_s"]["median"] for r in training.values()],
          xerr=[[r["tokens_per_s"]["median"] - r["tokens_per_s"]["min"] for r in training.values()],
                [r["tokens_per_s"]["max"] - r["tokens_per_s"]["median"] for r in training.values()]])
  ax.set(xlabel="tokens / s", title="training step throughput")
  files.append("training_throughput.png")
  fig.tight_layout()
  fig.savefig(out / files[-1], dpi=100)
  plt.close(fig)
  return files

