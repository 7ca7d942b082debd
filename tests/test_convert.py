"""Conversion of official torchscale RetNet checkpoints: logits against torchscale's own forms, refusals, the script.

Needs the `torch` extra and torchscale (`pip install -e '.[torch]' && pip install --no-deps torchscale==0.3.0`);
skipped without them.
"""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from configs import retnet as retnet_config
from retnet_jax.interop import convert
from retnet_jax.training import train_state
from tests.helpers import forward, random_tokens, run_script

torch = pytest.importorskip("torch")
try:
  RetNetConfig, RetNetDecoder = convert.torchscale_classes()
except ImportError as error:
  pytest.skip(f"torchscale is not installed ({error})", allow_module_level=True)

MODES = ("parallel", "chunkwise", "recurrent")
# Two shapes: torchscale's defaults (gelu, unscaled embeddings), and its fairseq recipe (swish, embeddings scaled by
# sqrt(d_model)) with tied embeddings, an embedding norm and three heads. Neither length is a multiple of the chunk.
SHAPES = {
    "defaults": (dict(decoder_embed_dim=32, decoder_value_embed_dim=48, decoder_ffn_embed_dim=48, decoder_layers=2,
                      decoder_retention_heads=2, vocab_size=61, recurrent_chunk_size=8), 21),
    "recipe": (dict(decoder_embed_dim=48, decoder_value_embed_dim=72, decoder_ffn_embed_dim=80, decoder_layers=2,
                    decoder_retention_heads=3, vocab_size=53, recurrent_chunk_size=4, activation_fn="swish",
                    no_scale_embedding=False, share_decoder_input_output_embed=True, layernorm_embedding=True), 11),
}


def torchscale_decoder(options, seed=0):
  """A torchscale RetNetDecoder in eval mode with its own initialisation, norm scales made random too."""
  torch.manual_seed(seed)
  config = RetNetConfig(**options)
  decoder = RetNetDecoder(config, embed_tokens=torch.nn.Embedding(options["vocab_size"],
                                                                                   options["decoder_embed_dim"]))
  with torch.no_grad():
    for name, param in decoder.named_parameters():
      if "norm" in name:
        param.add_(0.2 * torch.randn_like(param))
  return decoder.eval()


def torchscale_logits(options, state_dict, tokens):
  """torchscale's logits in its three forms: parallel, chunkwise (`chunkwise_recurrent`), and recurrent, one
  token at a time through `incremental_state`."""
  results, decoders = {}, {}
  with torch.no_grad():
    for mode in ("parallel", "chunkwise"):
      decoders[mode] = torchscale_decoder({**options, "chunkwise_recurrent": mode == "chunkwise"})
      decoders[mode].load_state_dict(state_dict)
      results[mode] = decoders[mode](torch.as_tensor(tokens))[0].numpy()
    incremental_state, steps = {}, []
    for n in range(tokens.shape[1]):
      steps.append(decoders["parallel"](torch.as_tensor(tokens[:, :n + 1]),
                                        incremental_state=incremental_state)[0].numpy())
    results["recurrent"] = np.concatenate(steps, axis=1)
  return results


def our_logits(model, tokens):
  return {mode: np.asarray(forward(model, tokens, None, mode)[0]) for mode in MODES}


def max_diff(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_logits_match_torchscale_in_each_form(shape):
  """Each of our forms gives torchscale's logits in the same form (float32; measured 1e-6 to 2e-5 on logits up
  to ~60).

  torchscale's three forms differ among themselves: each divides a head's raw output by its own positive scalar
  (parallel: sqrt of the decay sum and the clamped absolute row sum of the decayed scores; recurrent: sqrt of
  the decay sum; chunkwise: in-chunk decay sums and the larger of the clamped in-chunk sum of |scores| and the
  carried state's magnitude).
  The per-head RMSNorm would cancel any such scalar, but for its epsilon: at initialisation scale the head
  outputs are small, eps = 1e-6 is not negligible beside their mean square, and the chunkwise and parallel
  logits differ by 1e-2 to 1e-1 (asserted below, so that the match per form checks the normalisers themselves).
  `stability_norm_style="torchscale"` reproduces each form's scalars.
  """
  options, length = SHAPES[shape]
  decoder = torchscale_decoder(options)
  state_dict = decoder.state_dict()
  tokens = random_tokens(2, length, options["vocab_size"])
  theirs = torchscale_logits(options, state_dict, tokens)
  model, config = convert.load_torchscale(state_dict, options)
  assert config.model.stability_norm_style == "torchscale"
  ours = our_logits(model, tokens)
  errors = {mode: max_diff(ours[mode], theirs[mode]) for mode in MODES}
  assert all(error < 1e-4 for error in errors.values()), errors
  assert max_diff(theirs["chunkwise"], theirs["parallel"]) > 1e-3


def test_scanned_import_gives_the_same_logits():
  """`scan_layers=True` stacks the imported blocks: the logits of the unrolled import in every form."""
  options, length = SHAPES[next(iter(SHAPES))]
  state_dict = torchscale_decoder(options).state_dict()
  tokens = random_tokens(2, length, options["vocab_size"])
  unrolled, _ = convert.load_torchscale(state_dict, options)
  scanned, config = convert.load_torchscale(state_dict, options, scan_layers=True)
  assert config.model.scan_layers and not isinstance(scanned.blocks, nnx.List)
  ours, theirs = our_logits(scanned, tokens), our_logits(unrolled, tokens)
  assert all(max_diff(ours[mode], theirs[mode]) < 1e-5 for mode in MODES)


def test_torchscale_forms_agree_without_norm_epsilon():
  """With eps = 0 the per-head norm cancels every normaliser exactly: torchscale's three forms agree with each
  other (and with ours) to float32 rounding. (The length is a multiple of the chunk: torchscale pads a partial
  last chunk with zero embeddings, which an RMSNorm without epsilon turns into NaN.)"""
  options = {**SHAPES["recipe"][0], "layernorm_eps": 0.0}
  decoder = torchscale_decoder(options, seed=1)
  tokens = random_tokens(2, 12, options["vocab_size"], seed=1)
  logits = torchscale_logits(options, decoder.state_dict(), tokens)
  model, _ = convert.load_torchscale(decoder.state_dict(), options)
  logits["ours"] = forward(model, tokens, None, "parallel")[0]
  assert max(max_diff(value, logits["parallel"]) for value in logits.values()) < 1e-4


def small_state_dict():
  options = SHAPES["defaults"][0]
  return options, {name: tensor.numpy() for name, tensor in torchscale_decoder(options).state_dict().items()}


def fairseq_checkpoint(state_dict):
  """`state_dict` as fairseq saves a torchscale language model: under `model`, named `decoder.NAME`, with the
  training state beside it."""
  return {"model": {f"decoder.{name}": value for name, value in state_dict.items()},
          "cfg": {"model": {"_name": "retnet_base"}}, "extra_state": {"epoch": 1}}


def test_fairseq_checkpoints_are_unwrapped():
  options, state_dict = small_state_dict()
  wrapped, _ = convert.load_torchscale(fairseq_checkpoint(state_dict), options)
  plain, _ = convert.load_torchscale(state_dict, options)
  assert jax.tree.all(jax.tree.map(np.array_equal, nnx.to_pure_dict(nnx.state(wrapped)),
                                   nnx.to_pure_dict(nnx.state(plain))))


@pytest.mark.parametrize("remove,add,message", [
    ("layers.1.ffn.gate.weight", {"layers.2.ffn.gate.weight": (48, 32)},
     r"missing tensors: \[layers\.1\.ffn\.gate\.weight\]; unexpected tensors: \[layers\.2\.ffn\.gate\.weight\]"),
    (None, {"layers.0.retention.v_proj.weight": (40, 32)},
     r"layers\.0\.retention\.v_proj\.weight has shape \(40, 32\) but the config needs \(48, 32\)"),
])
def test_missing_extra_and_misshapen_tensors_are_named(remove, add, message):
  options, state_dict = small_state_dict()
  if remove:
    del state_dict[remove]
  state_dict.update({name: np.zeros(shape, np.float32) for name, shape in add.items()})
  with pytest.raises(ValueError, match=message):
    convert.load_torchscale(state_dict, options)


def test_july_2023_layout_is_refused():
  """The first release: LayerNorm (weight and bias) everywhere, biased projections, a plain FFN with a sub-norm."""
  options, state_dict = small_state_dict()
  for i in range(2):
    del state_dict[f"layers.{i}.ffn.gate.weight"]
    for name in ("retention_layer_norm", "final_layer_norm", "ffn.ffn_layernorm", "retention.q_proj", "ffn.fc1"):
      state_dict[f"layers.{i}.{name}.bias"] = np.zeros(32, np.float32)
    state_dict[f"layers.{i}.ffn.ffn_layernorm.weight"] = np.ones(48, np.float32)
  with pytest.raises(ValueError, match=r"July-2023 layout.*layers\.0\.ffn\.fc1\.bias"):
    convert.load_torchscale(state_dict, options)


@pytest.mark.parametrize("override,message", [
    (dict(deepnorm=True), "deepnorm=True"),
    (dict(decoder_normalize_before=False, subln=False), "decoder_normalize_before=False"),
    (dict(xpos_rel_pos=True), "xpos_rel_pos=True"),
    (dict(activation_fn="tanh"), "activation_fn='tanh'"),
    (dict(vocab_size=99), "vocab_size=99"),
    (dict(decoder_learned_heads=3), r"unknown RetNetConfig option\(s\) \['decoder_learned_heads'\]"),
])
def test_unsupported_options_are_refused(override, message):
  options, state_dict = small_state_dict()
  with pytest.raises(ValueError, match=message):
    convert.load_torchscale(state_dict, {**options, **override})


@pytest.mark.slow
def test_script_writes_a_checkpoint_that_restore_model_loads(tmp_path):
  """torch.save'd fairseq checkpoint + JSON config -> scripts/convert_torchscale.py -> train_state.restore_model: same
  logits."""
  options, length = SHAPES["recipe"]
  decoder = torchscale_decoder(options)
  torch.save(fairseq_checkpoint(decoder.state_dict()), tmp_path / "retnet.pt")
  (tmp_path / "retnet.json").write_text(json.dumps(options))
  workdir = tmp_path / "converted"
  convert_script = lambda state_dict, torchscale_config: run_script(
      "convert_torchscale.py", f"--state_dict={state_dict}", f"--torchscale_config={torchscale_config}",
      f"--workdir={workdir}")
  (tmp_path / "list.json").write_text("[1, 2]")
  (tmp_path / "not_torch.pt").write_text("not a torch file")
  for state_dict, torchscale_config, message in [
      ("retnet.pt", "list.json", "list.json holds a JSON list; it must be a JSON object"),
      ("not_torch.pt", "retnet.json", "not_torch.pt could not be read as a torch.save file")]:
    result = convert_script(tmp_path / state_dict, tmp_path / torchscale_config)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-3000:]
  assert not workdir.exists()
  result = convert_script(tmp_path / "retnet.pt", tmp_path / "retnet.json")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "python scripts/evaluate.py --config=configs/retnet.py:torchscale_base" in result.stdout
  assert (workdir / "config.json").is_file()

  # The config the printed flags give: the preset plus the model overrides.
  _, converted = convert.load_torchscale(decoder.state_dict(), options)
  config = retnet_config.get_config(converted.preset)
  config.model.update(convert.model_overrides(converted))
  model, step = train_state.restore_model(config, workdir)
  assert step == 0
  tokens = random_tokens(2, length, options["vocab_size"], seed=2)
  theirs = torchscale_logits(options, decoder.state_dict(), tokens)
  assert max_diff(forward(model, tokens, None, "parallel")[0], theirs["parallel"]) < 1e-4
