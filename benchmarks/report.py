"""The benchmark's results as Markdown, and the SI-prefixed numbers it prints."""

from __future__ import annotations

from retnet_jax.core import markdown


def _prefix(x: float, unit: str) -> tuple[float, str]:
  """(factor, SI prefix) to print `x` in `unit`; none for a unitless number."""
  return next(((f, p) for f, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")) if unit and abs(x) >= f),
              (1.0, ""))


def fmt(x: float | None, unit: str = "") -> str:
  """`x` to 3 significant digits with an SI prefix of `unit`; "-" for None."""
  if x is None:
    return "-"
  factor, prefix = _prefix(x, unit)
  return f"{x / factor:.3g} {prefix}{unit}".strip()


def fmt_range(s: dict[str, float], unit: str = "", scale: float = 1.0) -> str:
  """`median [min-max]`, the range in the median's unit prefix."""
  median, low, high = (s[k] * scale for k in ("median", "min", "max"))
  factor, _ = _prefix(median, unit)
  return f"{fmt(median, unit)} [{low / factor:.3g}-{high / factor:.3g}]"


def to_markdown(results) -> str:
  """The results dict of `sections.run` as a Markdown report."""
  meta, ceilings = results["meta"], results["ceilings"]
  lines = [f"# Benchmark ({meta['suite']} suite)", "",
           f"`{meta['command']}` on {meta['machine']}, {meta['date']}; jax {meta['jax']}. Model: "
           + ", ".join(f"{k} {v}" for k, v in meta["size"].items())
           + f" ({meta['params']:,} parameters); training batch {meta['batch_size']} x {meta['seq_len']} on one "
           f"device; the forward sweep and decoding on {meta['inference_devices']} (tensor-parallel). "
           f"Medians [min-max] over timed runs after a warm-up. Peak memory: {meta['memory_source']}, "
           "(+ the part above the memory in use before the call); XLA buffers: the compiled program's arguments "
           "+ temporaries + outputs, summed over its devices. Load average (1, 5, 15 min) at start "
           f"{', '.join(f'{x:.1f}' for x in meta['load_average_start'])}, at end "
           f"{', '.join(f'{x:.1f}' for x in meta['load_average_end'])}: other processes share the cores when "
           "it exceeds ~1.", "", "## Ceilings", "",
           "Measured interleaved with what they are compared to: the matmuls with the training steps, the read "
           "bandwidth with the decoding runs.", ""]
  lines += markdown.table(["ceiling", "median [min-max]"], [
      [f"matmul {name} ({ceilings['matmul_size']}^2)", fmt_range(s, "FLOP/s")]
      for name, s in ceilings["matmul_flops"].items()] + [
      [f"memory read ({fmt(ceilings['read_array_bytes'], 'B')} reduction)",
       fmt_range(ceilings["memory_read_bytes_per_s"], "B/s")]])
  lines += ["", "## Training step", ""]
  header = ["model/form/dtype", "tokens/s", "step s", "compile s", "peak memory", "XLA buffers", "MFU"]
  lines += markdown.table(header, [
      [name, fmt_range(r["tokens_per_s"]), fmt_range(r["step_s"]), fmt(r["compile_s"]),
       f"{fmt(r['memory']['peak_bytes'], 'B')} (+{fmt(r['memory']['above_start_bytes'], 'B')})",
       fmt(r["compiled_bytes"], "B"), f"{r['mfu']:.1%}"]
      for name, r in results["training"].items()])
  tokens_per_s = {name: r["tokens_per_s"]["median"] for name, r in results["training"].items()}
  gated = [name.split("/", 1)[1] for name in tokens_per_s if name.startswith("gated/")]
  if gated:  # (absent from the results of earlier runs)
    lines += ["", "Gated retention (`model.mixer=\"gated_retention\"`: a decay per token from a gate) over RetNet "
              "(`retnet/`, the same size), tokens/s: " + ", ".join(
                  f"{form} {tokens_per_s[f'gated/{form}'] / tokens_per_s[f'retnet/{form}']:.2f}x" for form in gated)
              + "."]
  ts = results["torchscale"]
  lines += ["", "## torchscale (official implementation), same configuration", "", ts["note"], ""]
  if ts["ratios"]:
    lines += markdown.table(["ours / theirs", "ratio"], [[k, f"{v:.2f}x"] for k, v in ts["ratios"].items()])
  for kind in ("forward", "train"):
    sweep, analysis = results["lengths"][kind], results["lengths"][f"{kind}_analysis"]
    lengths = sorted({p["seq_len"] for points in sweep.values() for p in points})
    by = {name: {p["seq_len"]: p for p in points} for name, points in sweep.items()}
    cell = lambda p: "-" if p is None else (f"{fmt_range(p['seconds'], 's')}, {fmt(p['memory']['peak_bytes'], 'B')} "
                                            f"peak (+{fmt(p['memory']['above_start_bytes'], 'B')}), "
                                            f"{fmt(p['compiled_bytes'], 'B')} XLA")
    lines += ["", f"## {kind.capitalize()} vs sequence length (batch 1)", ""]
    lines += markdown.table(["tokens"] + list(sweep),
                            [[n] + [cell(by[name].get(n)) for name in sweep] for n in lengths])
    lines += ["", (f"Chunkwise faster than parallel from {analysis['crossover_seq_len']} tokens. "
                  if analysis["crossover_seq_len"] else "Chunkwise faster than parallel at none of these lengths. ")
              + "Growth exponent between the two longest lengths (1 linear, 2 quadratic), time: "
              + ", ".join(f"{k} {fmt(v)}" for k, v in analysis["time_growth_exponent"].items())
              + "; XLA buffers: "
              + ", ".join(f"{k} {fmt(v)}" for k, v in analysis["compiled_bytes_growth_exponent"].items()) + "."]
  dec = results["decoding"]
  lines += ["", f"## Decoding (greedy `Sampler.decode` of {dec['new_tokens']} tokens after a prefilled prompt, "
            "no stream callback)", ""]
  lines += markdown.table(["model", "tokens/s"], [
      [f"{name} {key.replace('_', ' ')}" + (f" after {dec['prompt_len']} tokens" if name != "torchscale" else ""),
       fmt_range(value)]
      for name, entry in dec["throughput"].items() for key, value in entry.items()])
  if "gated" in dec["throughput"]:
    lines += ["", "Gated retention over RetNet, decoding tokens/s: " + ", ".join(
        f"{key.replace('_', ' ')} {value['median'] / dec['throughput']['retnet'][key]['median']:.2f}x"
        for key, value in dec["throughput"]["gated"].items()) + "."]
  lines += ["", "Per-token latency vs context (batch 1):", ""]
  names = list(dec["latency"])
  lines += markdown.table(["context"] + [f"{n} ms/token" for n in names] + [f"{n} state" for n in names], [
      [c] + [fmt_range(dec["latency"][n][i]["latency_s"], scale=1e3) for n in names]
      + [fmt(dec["latency"][n][i]["state_bytes"], "B") for n in names]
      for i, c in enumerate(dec["latency_contexts"])])
  lines += ["", "Latency longest / shortest context: " + ", ".join(
      f"{k} {v:.2f}" for k, v in dec["latency_ratio"].items())
      + f". Weight-read floor: {fmt(dec['param_bytes'], 'B')} / read bandwidth = {dec['weight_read_floor_s'] * 1e3:.2f}"
      f" ms/token ({dec['weight_read_floor_tokens_per_s']:.0f} tok/s); batch 1 reaches "
      f"{dec['batch_1_over_floor']:.0%} of it. Large batch: {fmt(dec['large_batch_flops_per_s'], 'FLOP/s')} "
      f"({dec['large_batch_fraction_of_matmul_ceiling']:.0%} of the float32 matmul ceiling). Large-batch "
      "decoding state / peak memory: " + ", ".join(
          f"{k} {fmt(v['state_bytes'], 'B')} / {fmt(v['memory']['peak_bytes'], 'B')}"
          for k, v in dec["large_batch"].items()) + "."]
  long, seg = results["long_training"], results["long_training"]["segmented"]
  lines += ["", f"## Chunkwise training of one {long['seq_len']}-token sequence", "",
            f"Whole sequence: {fmt(long['whole']['compiled_bytes'], 'B')} XLA buffers (compiled only). "
            f"`train.segment_len={long['segment_len']}`: {fmt(seg['compiled_bytes'], 'B')} XLA buffers, peak memory "
            f"{fmt(seg['memory']['peak_bytes'], 'B')} (+{fmt(seg['memory']['above_start_bytes'], 'B')}), "
            f"step {fmt_range(seg['step_s'], 's')}, {fmt_range(seg['tokens_per_s'])} tokens/s."]
  resets = results["document_resets"]
  lines += ["", "## Document resets (packed documents, `segment_ids`)", "",
            f"The same train step without and with the documents of a packed batch ({resets['documents_per_batch']} "
            f"documents of mean length {resets['document_len']}), interleaved.", ""]
  lines += markdown.table(["form/dtype", "tokens/s without", "tokens/s with", "with / without"], [
      [name, fmt_range(r["whole_tokens_per_s"]), fmt_range(r["documents_tokens_per_s"]), f"{r['ratio']:.3f}"]
      for name, r in resets["cases"].items()])
  lines += ["", "## Targets", ""]
  met = {True: "yes", False: "no", None: "not measured"}
  lines += markdown.table(["target", "value", "met"], [[t["target"], fmt(t["value"]), met[t["met"]]]
                                                      for t in results["targets"]])
  return "\n".join(lines) + "\n"

