"""Passkey retrieval of a checkpoint against context length and needle depth:

    python scripts/passkey.py --config=configs/retnet.py:small --workdir=runs/shakespeare \\
      --lengths=256,512,1024,2048 --depths=0,0.25,0.5,0.75,1 --samples=16

Each cell hides `--samples` random 5-digit keys at one depth of filler text of one length, asks for the key and
scores greedy decoding (prefilled in `--mode`, decoded recurrently) by exact match of every answer token. Prints a
table, the accuracy to expect (near 0 for a model not trained on passkey examples: --config.data.synthetic=passkey
trains one) and, as the last line of stdout, one JSON object, also written to WORKDIR/passkey_step_STEP.json with a
heatmap in WORKDIR/passkey_step_STEP.png.
"""

from retnet_jax.runs import cli

if __name__ == "__main__":
  cli.prepare()  # first, before numpy and jax start threads

from absl import flags

from retnet_jax.evaluation import passkey_eval
from retnet_jax.input_pipeline import passkey, tokenizer as tokenizer_lib
from retnet_jax.models import architectures
from retnet_jax.runs import workdir
from retnet_jax.training import metrics, run_config, train_state

_CONFIG = cli.config_flag("Config file and preset (default: the preset and model of the workdir's config.json).")
_WORKDIR = cli.workdir_flag("Training run directory holding checkpoints/.")
_STEP = cli.step_flag("Checkpoint step to evaluate (default: the latest).")
_LENGTHS = flags.DEFINE_list("lengths", None, "Context lengths in tokens, answer included (default: 1, 2 and 4 "
                             "times train.seq_len).")
_DEPTHS = flags.DEFINE_list("depths", ["0", "0.25", "0.5", "0.75", "1"], "Needle depths: the fraction of the "
                            "filler before the needle, in [0, 1].")
_SAMPLES = flags.DEFINE_integer("samples", 8, "Examples (keys) per length and depth.", lower_bound=1)
_MODE = flags.DEFINE_enum("mode", None, architectures.PREFILL_MODES, "Form of the prefill (decoding is recurrent; "
                          "default: the model's own, chunkwise for RetNet, parallel for a Transformer); the parallel "
                          "form's memory grows with the square of the length.")
_PREFILL_BLOCK = cli.prefill_block_flag()
_SEED = cli.seed_flag("Sample s of every cell hides the key of seed + s.")
_MAX_HOURS = cli.positive_float_flag("max_hours", 2.0, "Refuse a grid whose prompts would take longer than this on "
                                     "this device (timed on a short prompt before the grid runs).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None, "Examples per compiled call (default: a cell's samples).",
                                   lower_bound=1)


def _numbers(values: list[str], kind: type, flag: str) -> list:
  try:
    return [kind(value) for value in values]
  except ValueError:
    raise ValueError(f"--{flag}={','.join(values)} must be comma-separated {kind.__name__} values.") from None


def main():
  config = run_config.build(workdir.script_config(_CONFIG.value, _WORKDIR.value,
                                                  *cli.command_line_config(_CONFIG)))
  lengths = (_numbers(_LENGTHS.value, int, "lengths") if _LENGTHS.value is not None
             else [config.train.seq_len * k for k in (1, 2, 4)])
  tokenizer = tokenizer_lib.load(config.data.tokenizer, vocab_size=config.model.vocab_size)
  grid = passkey.make_grid(tokenizer, lengths, _numbers(_DEPTHS.value, float, "depths"), _SAMPLES.value,
                           _SEED.value)  # every example checked before the checkpoint is read
  own = architectures.prefill_modes(config.model)
  mode = own[0] if _MODE.value is None else _MODE.value
  if mode not in own:
    raise ValueError(f"--mode={mode}: a {config.model.architecture} prefills in {', '.join(own)}.")
  model, step = train_state.restore_model(config, _WORKDIR.value, _STEP.value)
  passkey_eval.check_memory(model, mode, grid, _BATCH_SIZE.value, _PREFILL_BLOCK.value)  # sized before any runs
  generate = passkey_eval.greedy_generate(model, mode, _PREFILL_BLOCK.value)
  tokens, rate = passkey_eval.prompt_tokens(grid), passkey_eval.seconds_per_token(generate, grid)
  estimate = f"{tokens} prompt tokens take about {metrics.format_duration(tokens * rate)} here"
  if tokens * rate > 3600 * _MAX_HOURS.value:
    raise ValueError(f"--lengths={','.join(map(str, grid.lengths))}: {estimate} ({1e3 * rate:.3f} ms per token, "
                     f"timed on a short prompt), more than --max_hours={_MAX_HOURS.value:g}; choose shorter lengths, "
                     "fewer depths or samples, or raise --max_hours.")
  metrics.log(f"passkey: {estimate} (at least: a parallel prefill grows with the square of the length)")
  results = {"step": step, "workdir": str(_WORKDIR.value), "settings": cli.given_flags(), "mode": mode,
             "seed": _SEED.value,
             **passkey_eval.evaluate(generate, grid, _BATCH_SIZE.value, metrics.log)}
  print(passkey_eval.format_table(results))
  print(passkey_eval.expectation(workdir.trained_task(_WORKDIR.value)))
  line = metrics.write_results(results, workdir.results_file(_WORKDIR.value, "passkey", step, results["settings"]),
                               passkey_eval.plot_heatmap)
  print(line, flush=True)


if __name__ == "__main__":
  cli.run(main)
