"""Evaluates a checkpoint: `python scripts/evaluate.py --config=configs/retnet.py:small --workdir=runs/shakespeare`.

Prints a table and, as the last line of stdout, one JSON object, also written to WORKDIR/eval_step_STEP.json.
`--mode=all` evaluates every form of the model (RetNet: parallel, chunkwise, recurrent; Transformer: parallel,
recurrent) and checks that they agree. Data flags are
the training config's (`--config.data.files=...`, `--config.data.validation_files=...`).

Long context: `--eval_seq_len=4096 --by_position=16 --mode=chunkwise` evaluates sequences of 4096 tokens (longer
than training: the length-extrapolation curve) and adds each mode's loss in 16 equal position buckets
(`loss_by_position`), plotted to WORKDIR/eval_step_STEP_by_position.png. The chunkwise and recurrent forms run
block by block (`--eval_block` tokens) with the state carried, so `--eval_seq_len=1048576` takes one block's memory;
the validation split must hold a batch of such sequences (`--config.train.batch_size=1`, a long
`--config.data.validation_files`). With `--config.data.reset_at_documents` every form runs each document as if alone
and the buckets hold positions within the document.
"""

from retnet_jax.runs import cli

if __name__ == "__main__":
  cli.prepare()  # first, before numpy and jax start threads

import json
import sys

from absl import flags, logging

from retnet_jax.evaluation import evaluate
from retnet_jax.models import architectures
from retnet_jax.runs import workdir
from retnet_jax.training import metrics, run_config, train_state

_CONFIG = cli.config_flag("Config file and preset (default: the preset and model of the workdir's config.json).")
_WORKDIR = cli.workdir_flag("Training run directory holding checkpoints/.")
_STEP = cli.step_flag("Checkpoint step to evaluate (default: the latest).")
_MODE = flags.DEFINE_enum("mode", "parallel", architectures.MODES + ("all",), "The form to evaluate (a "
                          "Transformer has no chunkwise form), or all the model's forms.")
_MAX_BATCHES = flags.DEFINE_integer("max_batches", None, "Evaluate this many batches, their rows spread over the "
                                    "validation split (default: all).")
_EVAL_SEQ_LEN = flags.DEFINE_integer("eval_seq_len", None, "Tokens per validation sequence (default: the training "
                                     "train.seq_len); may be longer than training. The parallel form's memory grows "
                                     "with its square: use --mode=chunkwise or recurrent for long sequences.")
_EVAL_BLOCK = flags.DEFINE_integer("eval_block", None, "Tokens per block of the chunkwise and recurrent forms, which "
                                   "run long sequences block by block with the state carried: a multiple of "
                                   "model.chunk_size (default: 2048 in whole chunks; 0: whole sequences at once).")
_BY_POSITION = flags.DEFINE_integer("by_position", 0, "Number of equal position buckets (dividing the evaluation "
                                    "length) to report the loss of, and plot (0: off); with "
                                    "data.reset_at_documents, positions within each document.")


def main():
  config = run_config.build(workdir.script_config(_CONFIG.value, _WORKDIR.value,
                                                  *cli.command_line_config(_CONFIG)))
  seq_len = config.train.seq_len if _EVAL_SEQ_LEN.value is None else _EVAL_SEQ_LEN.value
  modes = architectures.modes(config.model) if _MODE.value == "all" else (_MODE.value,)
  evaluate.check_request(config, modes, seq_len, _BY_POSITION.value, _EVAL_BLOCK.value)  # before the checkpoint
  model, step = train_state.restore_model(config, _WORKDIR.value, _STEP.value)
  results = {"step": step, "workdir": str(_WORKDIR.value), "settings": cli.given_flags(),
             **evaluate.evaluate_model(model, config, modes, _MAX_BATCHES.value, seq_len, _BY_POSITION.value,
                                       _EVAL_BLOCK.value)}
  print(evaluate.format_table(results))
  plot = None
  if _BY_POSITION.value:
    plot = lambda results, png: evaluate.plot_loss_by_position(
        results, png.with_name(f"{png.stem}_by_position.png"), config.train.seq_len)
  line = metrics.write_results(results, workdir.results_file(_WORKDIR.value, "eval", step, results["settings"]),
                               plot)
  print(line, flush=True)
  nonfinite = json.loads(line).get("nonfinite")
  if nonfinite:
    logging.error(f"non-finite results at {nonfinite} (null in the JSON): the model diverged or its checkpoint is "
                  "damaged")
    sys.exit(1)
  if not results.get("modes_agree", True):
    logging.error("the retention forms disagree beyond the tolerance")
    sys.exit(1)


if __name__ == "__main__":
  cli.run(main)
