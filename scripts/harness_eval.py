"""Runs lm-evaluation-harness tasks on a checkpoint:

    python scripts/harness_eval.py --config=configs/retnet.py:small --workdir=runs/shakespeare \\
      --tasks=lambada_openai,hellaswag --num_fewshot=0 --limit=100 --batch_size=16

Prints the harness's results table and, as the last line of stdout, one JSON object (the step, the results and
where they were written); the harness's full results go to `--output_path` (a `.json` file, or a folder:
`FOLDER/lm_eval_step_STEP.json`; default: the workdir). `--model_args` takes the adapter's options
(`mode=chunkwise,max_length=1024`; see `retnet_jax.evaluation.lm_eval`). Needs the `eval` extra: pip install -e
'.[eval]'.
"""

from retnet_jax.runs import cli

if __name__ == "__main__":
  cli.prepare()  # first, before numpy and jax start threads

from pathlib import Path

from absl import flags
import lm_eval
from lm_eval import utils as harness_utils

from retnet_jax.evaluation import lm_eval as harness
from retnet_jax.runs import workdir
from retnet_jax.training import run_config

_CONFIG = cli.config_flag("Config file and preset (default: the preset and model of the workdir's config.json).")
_WORKDIR = cli.workdir_flag("Training run directory holding checkpoints/.")
_STEP = cli.step_flag("Checkpoint step to evaluate (default: the latest).")
_TASKS = flags.DEFINE_list("tasks", None, "Comma-separated task, group or tag names, or task YAML files.",
                           required=True)
_NUM_FEWSHOT = flags.DEFINE_integer("num_fewshot", None, "Few-shot examples per prompt (default: each task's).",
                                    lower_bound=0)
_LIMIT = cli.positive_float_flag("limit", None, "Examples per task: a count, or below 1 a fraction (for testing).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Contexts prefilled, continuations scored and prompts decoded "
                                   "per batch.", lower_bound=1)
_OUTPUT_PATH = flags.DEFINE_string("output_path", None, "A .json file (new, or results to replace), or a folder for "
                                   "lm_eval_step_STEP.json (default: the workdir).")
_INCLUDE_PATH = flags.DEFINE_string("include_path", None, "A folder of more task YAML files.")
_MODEL_ARGS = flags.DEFINE_string("model_args", "", "The adapter's options, e.g. mode=chunkwise,max_length=1024 "
                                  "(the checkpoint comes from --config, --workdir and --step).")


MAX_LIMIT = 2**31 - 1  # the harness slices its examples by --limit (itertools.islice)


def main():
  options = harness_utils.simple_parse_args_string(_MODEL_ARGS.value)
  misplaced = sorted(set(options) & {"workdir", "config", "step", "batch_size"} | {k for k in options if "." in k})
  if misplaced:
    raise ValueError(f"--model_args={_MODEL_ARGS.value!r} sets {misplaced}; give them as --workdir, --config, "
                     "--config.x.y, --step and --batch_size.")
  limit = _LIMIT.value
  if limit is not None and limit >= 1 and (limit != int(limit) or limit > MAX_LIMIT):
    raise ValueError(f"--limit={limit:g} is a count of examples per task, so a whole number from 1 to {MAX_LIMIT} (or "
                     "below 1 a fraction); leave --limit unset for every example.")
  if _OUTPUT_PATH.value and Path(_OUTPUT_PATH.value).suffix == ".json":
    workdir.check_results_path(_OUTPUT_PATH.value, "--output_path")
  task_manager, tasks = harness.load_tasks(_TASKS.value, _INCLUDE_PATH.value)
  config = run_config.build(workdir.script_config(_CONFIG.value, _WORKDIR.value,
                                                  *cli.command_line_config(_CONFIG)))
  lm = harness.RetNetLM(_WORKDIR.value, config, _STEP.value, batch_size=_BATCH_SIZE.value, **options)
  results = lm_eval.simple_evaluate(
      model=lm, tasks=tasks, task_manager=task_manager, num_fewshot=_NUM_FEWSHOT.value,
      limit=int(limit) if limit is not None and limit >= 1 else limit, batch_size=_BATCH_SIZE.value,
      log_samples=False)
  print(harness_utils.make_table(results))
  if "groups" in results:
    print(harness_utils.make_table(results, "groups"))
  results["settings"] = cli.given_flags()
  path = Path(_OUTPUT_PATH.value or _WORKDIR.value)
  if path.suffix != ".json":
    path = workdir.results_file(path, "lm_eval", lm.step, results["settings"])
  summary = {"step": lm.step, "results": results["results"], "groups": results.get("groups", {}),
             "output_path": harness.write_results(results, path)}
  print(harness.results_json(summary), flush=True)


if __name__ == "__main__":
  cli.run(main)
