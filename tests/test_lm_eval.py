"""lm-evaluation-harness integration, offline: local tasks over a JSON-lines file, scored by a tiny trained RetNet
and a Transformer, against log-likelihoods and greedy decoding computed directly from the parallel logits."""

import copy
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")

import datasets  # noqa: E402
import huggingface_hub  # noqa: E402
import tokenizers  # noqa: E402
from lm_eval import utils as harness_utils  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from retnet_jax.evaluation import lm_eval as harness  # noqa: E402
from retnet_jax.input_pipeline.tokenizer import ByteTokenizer  # noqa: E402
from retnet_jax.training import train_state  # noqa: E402
from tests.helpers import forward, run_script, tiny_model, tiny_transformer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIG = f"{REPO / 'configs' / 'retnet.py'}:tiny"
SEQ_LEN = 32  # the training length of the shared tiny run (`trained` in tests/conftest.py)
DOCS = [
    {"question": "ROMEO: Where is", "choices": [" Juliet", " the sun", " thy"], "answer": 0,
     "text": "First Citizen:\nBefore we proceed any further, hear me speak."},
    {"question": "KING: Good", "choices": [" morrow", " night"], "answer": 1, "text": "All:\nSpeak, speak."},
    {"question": "", "choices": ["Hello", " xx"], "answer": 0,  # an empty context: scored after the prefix token
     "text": "Citizen: You are all resolved rather to die than to famish? Resolved, resolved, and four windows."},
]
TASKS = {
    "tiny_mc": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
               "doc_to_target: answer\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n",
    "tiny_gen": "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{choices[answer]}}'\n"
                "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
                "metric_list:\n  - metric: exact_match\n",
    "tiny_ppl": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                "metric_list:\n  - metric: bits_per_byte\n",
}


@pytest.fixture(scope="module", autouse=True)
def offline():
  """The harness and datasets never reach the network here."""
  with pytest.MonkeyPatch.context() as patch:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
      patch.setenv(name, "1")
    patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    patch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    yield


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
  """Task YAML files (multiple choice, generation, rolling log-likelihood) over one JSON-lines file."""
  folder = tmp_path_factory.mktemp("tasks")
  (folder / "docs.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
  for name, body in TASKS.items():
    (folder / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                         f"    test: {folder / 'docs.jsonl'}\ntest_split: test\n{body}")
  return folder


def parallel_logits(model):
  """`logits(ids)`: the parallel form's float64 logits `[len(ids), V]` of one sequence (right-padded to 64 tokens,
  which a causal model's earlier logits do not see: one compilation)."""
  def logits(ids):
    padded_1xL = np.pad(np.asarray(ids, np.int32), (0, 64 - len(ids)))[None]
    return np.asarray(forward(model, padded_1xL, None, "parallel")[0][0, :len(ids)], np.float64)

  return logits


def reference_score(logits, context: list[int], continuation: list[int]) -> tuple[float, bool]:
  """(log-probability, greedy) of the continuation from one parallel pass over context and continuation."""
  logits = logits(context + continuation[:-1])[len(context) - 1:]
  logprobs = logits - logits.max(-1, keepdims=True)
  logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
  return float(logprobs[np.arange(len(continuation)), continuation].sum()), bool(
      (logits.argmax(-1) == continuation).all())


def reference_rolling(logits, tokens: list[int], prefix: int, window: int) -> float:
  """The text's log-probability in disjoint windows: window k predicts tokens[k*w:(k+1)*w] from the w tokens
  before each (the prefix token first): its own, and for a last, shorter window, those before it too."""
  shifted = [prefix] + tokens
  total = 0.0
  for start in range(0, len(tokens), window):
    end = min(start + window, len(tokens))
    total += reference_score(logits, shifted[max(0, end - window):start + 1], tokens[start:end])[0]
  return total


def reference_greedy(logits, tokenizer, prompt: list[int], steps: int, until: str) -> str:
  """Greedy decoding by repeated parallel passes, cut at the first stop string."""
  ids = list(prompt)
  for _ in range(steps):
    ids.append(int(np.argmax(logits(ids)[-1])))
  return tokenizer.decode(np.asarray(ids[len(prompt):])).split(until, 1)[0]


def test_simple_evaluate_by_registry_name_scores_as_the_parallel_logits(trained, tasks_dir):
  """The three request types through the harness's own loop (batches of 2, contexts prefilled chunkwise), against
  the model's parallel logits."""
  config, workdir, _ = trained
  results = lm_eval.simple_evaluate(
      model="retnet_jax", model_args=f"workdir={workdir},config={CONFIG},config.train.seq_len={SEQ_LEN},mode=chunkwise",
      tasks=list(TASKS), task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
      batch_size=2, limit=3, log_samples=True, bootstrap_iters=0)
  assert results["config"]["step"] == config.train.steps and results["config"]["mode"] == "chunkwise"
  logits = parallel_logits(train_state.restore_model(config, workdir)[0])
  tokenizer = ByteTokenizer()
  encode = lambda text: tokenizer.encode(text).tolist()
  samples = results["samples"]
  choices_scored = 0
  for sample in samples["tiny_mc"]:
    for (context, continuation), [(logprob, greedy)] in zip(sample["arguments"], sample["resps"]):
      expected = reference_score(logits, encode(context) or [harness.NEWLINE_BYTE], encode(continuation))
      assert logprob == pytest.approx(expected[0], rel=1e-5, abs=1e-4) and greedy == expected[1]
      choices_scored += 1
  assert choices_scored == 7
  for sample in samples["tiny_ppl"]:
    [[logprob]], [(text,)] = sample["resps"], sample["arguments"]
    expected = reference_rolling(logits, encode(text), harness.NEWLINE_BYTE, SEQ_LEN)
    assert logprob == pytest.approx(expected, rel=1e-5, abs=1e-4)
  assert max(len(doc["text"]) for doc in DOCS) > 3 * SEQ_LEN  # several windows
  for sample in samples["tiny_gen"]:
    [[text]], [(context, _)] = sample["resps"], sample["arguments"]
    assert text == reference_greedy(logits, tokenizer, encode(context) or [harness.NEWLINE_BYTE], 8, "\n")
  assert 0 <= results["results"]["tiny_mc"]["acc,none"] <= 1


@pytest.mark.devices(8)
def test_a_mesh_splitting_sequences_scores_as_one_device(trained):
  """On a (1, 1, 1, 8) mesh each call's tokens split over 8 devices in whole chunks of 8: continuations of 1 to 3
  tokens are right-padded to 64 (they failed: "its length 16 must be a multiple of 8 x chunk_size 8 = 64: pad or
  cut the sequences", which a harness user cannot act on), and score as on one device."""
  config = copy.deepcopy(trained.config)
  config.train.seq_len = 64  # a multiple of 8 devices x chunk 8: the context the mesh takes
  requests = [(None, [1, 2, 3, 4, 5, 6, 7], [8, 9, 10]), (None, [3] * 20, [4, 5]), (None, [9], [7])]
  expected = harness.RetNetLM(workdir=str(trained.workdir), config=config, batch_size=2)._loglikelihood_tokens(
      requests)
  config.mesh.shape = (1, 1, 1, 8)
  split = harness.RetNetLM(workdir=str(trained.workdir), config=config, batch_size=2)
  for (logprob, greedy), (want, want_greedy) in zip(split._loglikelihood_tokens(requests), expected):
    assert logprob == pytest.approx(want, rel=1e-5, abs=1e-5) and greedy == want_greedy


@pytest.mark.parametrize("architecture", ["transformer", "hybrid", "gated_retention"])
def test_a_transformer_hybrid_or_gated_model_continues_from_its_state(tmp_path, architecture):
  """The adapter is generic over model(tokens, mode, state): a Transformer's KV cache carries the contexts, as do a
  hybrid RetNet's retention states and (its layer 1 attending over a window of 6 tokens) ring buffer, and a gated
  RetNet's kv states (their decay a function of each token)."""
  model = {"transformer": lambda: tiny_transformer(max_len=128),
           "hybrid": lambda: tiny_model(attention_layers=(1,), attention_window=6),
           "gated_retention": lambda: tiny_model(mixer="gated_retention")}[architecture]()
  tokenizer = ByteTokenizer()
  lm = harness.RetNetLM(model=model, tokenizer=tokenizer, max_length=16, batch_size=3)
  logits = parallel_logits(model)
  requests = [("To be", " or not"), ("To be", ","), ("", "Hi"), ("Now is the winter of our discontent", " made"),
              ("To be", " or not to be")]
  scores = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(requests)])
  for (context, continuation), (logprob, greedy) in zip(requests, scores):
    continuation = tokenizer.encode(continuation).tolist()
    whole = ((tokenizer.encode(context).tolist() or [10]) + continuation)[-(16 + 1):]  # the last max_length + 1
    expected = reference_score(logits, whole[:-len(continuation)], continuation)
    assert logprob == pytest.approx(expected[0], rel=1e-5, abs=1e-4) and greedy == expected[1]
  text = "Now is the winter of our discontent made glorious summer"
  [rolling] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
  assert rolling == pytest.approx(reference_rolling(logits, tokenizer.encode(text).tolist(), 10, 16), rel=1e-5)
  greedy = reference_greedy(logits, tokenizer, tokenizer.encode("To be").tolist(), 6, "\x00\x00")
  stop = greedy[2:4]  # a stop string of two tokens, met after two characters
  [text] = lm.generate_until([Instance("generate_until", {}, ("To be", {"until": [stop], "max_gen_toks": 6}), 0)])
  assert text == greedy.split(stop, 1)[0]


@pytest.mark.slow
def test_script_prints_the_table_and_writes_json(trained, tasks_dir, tmp_path):
  config, workdir, _ = trained
  output = tmp_path / "results.json"
  result = run_script("harness_eval.py", f"--workdir={workdir}",  # the model of its config.json
                      f"--config.train.seq_len={SEQ_LEN}", "--tasks=tiny_mc,tiny_gen", f"--include_path={tasks_dir}",
                      "--limit=2", "--batch_size=4", f"--output_path={output}", HF_HUB_OFFLINE="1",
                      HF_DATASETS_OFFLINE="1")
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.strip().splitlines()
  assert any(line.startswith("|tiny_mc ") for line in lines) and any(line.startswith("|tiny_gen") for line in lines)
  summary = json.loads(lines[-1])
  assert summary["step"] == config.train.steps and summary["output_path"] == str(output)
  assert set(summary["results"]) == {"tiny_mc", "tiny_gen"} and 0 <= summary["results"]["tiny_mc"]["acc,none"] <= 1
  written = json.loads(output.read_text())
  assert written["results"] == summary["results"] and written["config"]["workdir"] == str(workdir)
  assert written["n-samples"]["tiny_mc"] == {"original": 3, "effective": 2}


def test_without_config_the_workdirs_config_json_is_read(trained):
  """As evaluate, generate and passkey read a run: a gated or hybrid run needed every field repeated."""
  lm = harness.RetNetLM(workdir=str(trained.workdir), **{"config.model.param_dtype": "bfloat16"})
  assert lm.step == trained.config.train.steps and lm.model.config.d_model == trained.config.model.d_model
  assert lm.model.config.param_dtype == "bfloat16"


def test_bad_input_is_refused_naming_the_value_and_the_fix(tmp_path):
  """Each before the checkpoint is read (this workdir holds none)."""
  workdir = tmp_path / "run"
  args = dict(workdir=str(workdir), config=CONFIG)
  with pytest.raises(ValueError, match=r"model_args \['pretrained'\] are not options of the retnet_jax model"):
    harness.RetNetLM(**args, pretrained="gpt2")
  with pytest.raises(ValueError, match=r"batch_size='auto'.*no 'auto'"):
    harness.RetNetLM(**args, batch_size="auto")
  with pytest.raises(ValueError, match="mode='recurrent'"):
    harness.RetNetLM(**args, mode="recurrent")
  for name, value, minimum in (("max_length", "abc", 1), ("max_length", 0, 1), ("max_gen_toks", "2.5", 1),
                               ("seed", "x", 0), ("seed", -1, 0)):
    with pytest.raises(ValueError, match=rf"model_args {name}={value!r} must be an integer of at least {minimum}"):
      harness.RetNetLM(**args, **{name: value})
  with pytest.raises(ValueError, match="needs config=FILE:PRESET.*holds no config.json"):
    harness.RetNetLM(workdir=str(workdir))
  with pytest.raises(ValueError, match="'configs/missing.py' is not a file"):
    harness.RetNetLM(workdir=str(workdir), config="configs/missing.py:tiny")
  with pytest.raises(ValueError, match="config.model.d_modle names no config field"):
    harness.RetNetLM(**args, **{"config.model.d_modle": 64})
  # Requests longer than an unwindowed hybrid's KV cache (a Transformer's alike).
  with pytest.raises(ValueError, match=r"max_length=2048 tokens of context and continuation do not fit the KV cache "
                                       r"of model.attention_max_len=1024; raise it"):
    harness.RetNetLM(**args, max_length=2048, **{"config.model.attention_layers": (1,)})
  # A tokenizer beyond the checkpoint's vocabulary, and one without an end-of-document token to score text after.
  for size, message in ((300, "the tokenizer has 300 tokens but model.vocab_size=256"),
                        (10, "no end-of-document token .* prefix_token=ID")):
    path = tmp_path / f"tokenizer_{size}.json"
    tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0")).save(str(path))
    with pytest.raises(ValueError, match=message):
      harness.RetNetLM(**args, **{"config.data.tokenizer": str(path)})
  # Task files the adapter cannot run, refused as they load.
  bad = tmp_path / "bad_tasks"
  bad.mkdir()
  (bad / "docs.jsonl").write_text(json.dumps(DOCS[0]) + "\n")
  (bad / "beams.yaml").write_text(
      f"task: beams\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {bad / 'docs.jsonl'}\n"
      "test_split: test\n" + TASKS["tiny_gen"].replace("do_sample: false", "num_beams: 4"))
  with pytest.raises(ValueError, match=r"task 'beams': generation_kwargs \['num_beams'\] are not supported"):
    harness.load_tasks(["beams"], str(bad))
  with pytest.raises(ValueError, match="include_path=.* is not a folder"):
    harness.load_tasks(["beams"], str(bad / "docs.jsonl"))
  # A task file that is not YAML: named, not reported as an unknown task.
  (bad / "broken.yaml").write_text("task: broken\ndataset_path: [json\n")
  for names, include in ((["broken"], str(bad)), ([str(bad / "broken.yaml")], None)):
    with pytest.raises(ValueError, match=r"task files that do not parse as YAML: \[.*broken.yaml \(while parsing"):
      harness.load_tasks(names, include)


@pytest.mark.slow
def test_a_negative_num_fewshot_is_refused_by_the_script(tmp_path):
  result = run_script("harness_eval.py", f"--config={CONFIG}", f"--workdir={tmp_path}", "--tasks=tiny_mc",
                      "--num_fewshot=-1")
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert "error: flag --num_fewshot=-1: -1 is not a non-negative integer" in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
def test_a_nan_limit_is_refused_by_the_script(tmp_path):
  """--limit=nan was accepted (every comparison with nan is false: neither a count nor a fraction); the flag is
  `cli.positive_float_flag`, whose refusals of nan, inf, 0 and negatives test_cli checks."""
  result = run_script("harness_eval.py", f"--config={CONFIG}", f"--workdir={tmp_path}", "--tasks=tiny_mc",
                      "--limit=nan")
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert "error: flag --limit=nan: --limit must be a positive, finite number" in result.stderr, result.stderr[-3000:]


def test_results_that_cannot_be_written_are_not_reported_as_written(tmp_path):
  (tmp_path / "file").write_text("")
  assert harness.write_results({"results": {}}, tmp_path / "file" / "results.json") is None
  assert harness.write_results({"results": {}}, tmp_path / "out" / "results.json") == str(tmp_path / "out" /
                                                                                          "results.json")
  assert json.loads((tmp_path / "out" / "results.json").read_text()) == {"results": {}}



def test_rolling_loglikelihood_is_per_document():
  """Each request is one document, each window starts from an empty state: a request scores the same alone or
  batched with others, and its score is the sum of its windows' continuations in one packed row whose documents
  (segment_ids) are the windows."""
  model, tokenizer = tiny_model(), ByteTokenizer()
  lm = harness.RetNetLM(model=model, tokenizer=tokenizer, max_length=16, batch_size=3)
  texts = ["Now is the winter of our discontent made glorious summer", "To be, or not to be", "A horse!"]
  batched = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)])
  tokens, ids, scored = [], [], []  # scored: (request, first and last position predicting the continuation)
  for i, text in enumerate(texts):
    [alone] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert batched[i] == pytest.approx(alone, rel=1e-6)
    for context, continuation in map(harness_utils.make_disjoint_window, harness_utils.get_rolling_token_windows(
        tokenizer.encode(text).tolist(), harness.NEWLINE_BYTE, 16, context_len=1)):
      scored.append((i, len(tokens) + len(context) - 1, len(tokens) + len(context) + len(continuation) - 1))
      ids += [len(scored)] * (len(context) + len(continuation))
      tokens += context + continuation
  assert len(scored) > 2 * len(texts)  # several windows per request
  logits, _ = forward(model, jnp.asarray([tokens]), None, "parallel", jnp.asarray([ids]))
  logprobs = np.asarray(jax.nn.log_softmax(logits[0]), np.float64)
  expected = [0.0] * len(texts)
  for i, first, last in scored:
    expected[i] += logprobs[np.arange(first, last), tokens[first + 1:last + 1]].sum()
  assert batched == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("limit", ["1e30", "2.5"])
def test_a_limit_that_is_no_count_is_refused_naming_the_flag(tmp_path, limit):
  """--limit=1e30 ended in itertools.islice's own message, naming no flag."""
  result = run_script("harness_eval.py", f"--workdir={tmp_path}", "--tasks=tiny_mc", f"--limit={limit}")
  assert result.returncode == 1 and "Traceback" not in result.stderr
  shown = re.escape(f"{float(limit):g}")
  assert re.search(rf"^error: --limit={shown} is a count of examples per task, so a whole number from 1 to "
                   r"2147483647", result.stderr, flags=re.MULTILINE), result.stderr[-2000:]
