"""Samples text from a checkpoint, streaming it as it is produced:

    python scripts/generate.py --config=configs/retnet.py:small --workdir=runs/shakespeare \\
      --prompt="ROMEO:" --max_new_tokens=300 --temperature=0.8 --top_p=0.95

Prompts are prefilled in the chunkwise form (a Transformer's in the parallel form), then decoded token by token in
the recurrent form inside one compiled loop (RetNet's memory per sequence is constant in the context length; a
Transformer's KV cache holds `model.max_len` tokens). On a mesh that splits sequences
(`--config.mesh.shape=(1,1,1,8)`), a RetNet's prompts are prefilled split over those devices. The last line of stdout
is one JSON object with every prompt's completion.
"""

from retnet_jax.runs import cli

if __name__ == "__main__":
  cli.prepare()  # first, before numpy and jax start threads

import contextlib
import json

from absl import app, flags
import jax

from retnet_jax.core import sharding
from retnet_jax.evaluation import sampling, text_generation
from retnet_jax.input_pipeline import tokenizer as tokenizer_lib
from retnet_jax.models import architectures
from retnet_jax.runs import workdir
from retnet_jax.training import run_config, train_state

_CONFIG = cli.config_flag("Config file and preset (default: the preset and model of the workdir's config.json).")
_WORKDIR = cli.workdir_flag("Training run directory holding checkpoints/.")
_STEP = cli.step_flag("Checkpoint step to load (default: the latest).")
_PROMPT = flags.DEFINE_multi_string("prompt", ["\n"], "Prompt text; repeat the flag for a batch of prompts.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 200, "Tokens to generate per prompt (at most 2^20: the output "
                                "buffer holds them all on the device).", lower_bound=1, upper_bound=2**20)
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_len", 8192, "Longest prompt accepted, in tokens.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 decodes greedily.")
_TOP_K = flags.DEFINE_integer("top_k", None, "Sample from the k most likely tokens only.")
_TOP_P = flags.DEFINE_float("top_p", None, "Sample from the smallest set of tokens whose probability reaches p.")
_STOP = flags.DEFINE_multi_integer("stop_token", [], "Token id that ends a completion (repeatable).")
_SEED = cli.seed_flag("PRNG seed.")
_PREFILL = flags.DEFINE_enum("prefill_mode", None, architectures.PREFILL_MODES, "Form used for the prompt (default: "
                             "chunkwise, or parallel for a Transformer).")
_PREFILL_BLOCK = cli.prefill_block_flag()
_STREAM = flags.DEFINE_boolean("stream", True, "Print the first prompt's completion as it is produced.")
_STREAM_EVERY = flags.DEFINE_integer("stream_every", 8, "Tokens handed from the compiled loop to the console "
                                     "at a time (1: every token, one host callback each).")


def main():
  text_generation.check_prompts(_PROMPT.value, "--prompt")
  config = run_config.build(workdir.script_config(_CONFIG.value, _WORKDIR.value,
                                                  *cli.command_line_config(_CONFIG)))
  tokenizer = tokenizer_lib.load(config.data.tokenizer, vocab_size=config.model.vocab_size)
  model, step = train_state.restore_model(config, _WORKDIR.value, _STEP.value)
  prompts = list(_PROMPT.value)
  for i, prompt in enumerate(prompts):
    length = len(tokenizer.encode(prompt))
    if length > _MAX_PROMPT.value:
      raise app.UsageError(f"prompt {i} holds {length} tokens, more than --max_prompt_len={_MAX_PROMPT.value}.")
  if _STREAM.value:
    print(prompts[0], end="", flush=True)
  stop = tuple(_STOP.value) or ((tokenizer.eos_id,) if tokenizer.eos_id is not None else ())
  split = sharding.sequence_devices(config.mesh, jax.device_count()) > 1
  with sharding.placement(config.mesh).active() if split else contextlib.nullcontext():
    completions = text_generation.generate_text(
        sampling.Sampler(), model, tokenizer, prompts, print_row=0 if _STREAM.value else None,
        max_new_tokens=_MAX_NEW.value, key=jax.random.key(_SEED.value), temperature=_TEMPERATURE.value,
        top_k=_TOP_K.value, top_p=_TOP_P.value,
        stop_tokens=stop, prefill_mode=_PREFILL.value, prefill_block=_PREFILL_BLOCK.value,
        stream_every=_STREAM_EVERY.value)
  for prompt, completion in zip(prompts[1:] if _STREAM.value else prompts,
                                completions[1:] if _STREAM.value else completions):
    print("-" * 40 + "\n" + prompt + completion)
  print(json.dumps({"step": step, "samples": [{"prompt": p, "completion": c}
                                              for p, c in zip(prompts, completions)]}), flush=True)


if __name__ == "__main__":
  cli.run(main)
