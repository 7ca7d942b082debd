"""The cost of document resets: training throughput with and without packed documents (`segment_ids`), side by side.

Both cases of a form and dtype run the same step (loss, gradients, optimizer update) on the same tokens; the second
also passes the documents of a packed batch, random lengths of mean `Suite.document_len`.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from benchmarks.cases import make_config, train_case
from benchmarks.harness import compile_timed, interleave, random_tokens, rate
from benchmarks.suites import Suite
from retnet_jax.models.model import Model
from retnet_jax.training import losses, optimizer


def document_ids(batch: int, length: int, mean_len: int, seed: int = 0) -> np.ndarray:
  """`[batch, length]` int32 ids of a packed batch: documents of geometric random lengths of mean `mean_len`."""
  starts = np.random.default_rng(seed).random((batch, length)) < 1 / mean_len
  starts[:, 0] = False
  return np.cumsum(starts, axis=1).astype(np.int32)


def reset_train_case(config, ids: np.ndarray | None):
  """One train step of `config` (`losses.token_loss`, its gradients, the optimizer's update) on random tokens
  `[B, L + 1]`, with the documents `ids [B, L + 1]` or without (None)."""
  graphdef, params = nnx.split(Model(config.model, rngs=nnx.Rngs(config.seed)))
  tx = optimizer.make_optimizer(config.train)
  loss_and_grad = jax.value_and_grad(lambda params, tokens, ids: losses.token_loss(
      graphdef, params, tokens if ids is None else (tokens, None, ids), config.train.mode))

  def step(state, batch):
    params, opt_state = state
    loss, grads = loss_and_grad(params, *batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  state = (params, tx.init(params))
  batch = (random_tokens(config.train.batch_size, config.train.seq_len + 1, config.model.vocab_size), ids)
  compiled, compile_s, buffers = compile_timed(jax.jit(step, donate_argnums=0), state, batch)
  return train_case(compiled, state, batch, compile_s, buffers)


def measure(base, suite: Suite, source: str) -> dict[str, Any]:
  """Per form and dtype: tokens/s without and with document resets (interleaved, alternated) and their ratio."""
  ids = document_ids(suite.batch_size, suite.seq_len + 1, suite.document_len)
  cases = {}
  for mode, dtype in suite.document_forms:
    config = make_config(base, suite, dtype, mode, suite.seq_len, suite.batch_size)
    for name, docs in (("whole", None), ("documents", ids)):
      cases[f"retnet/{mode}/{dtype}/{name}"] = reset_train_case(config, docs)
  documents_per_batch = int(ids[:, -1].sum()) + len(ids)
  print(f"document resets: {len(cases)} cases, {documents_per_batch} documents per batch", flush=True)
  interleave(cases, suite.rounds, source)
  tokens = suite.batch_size * suite.seq_len
  results = {}
  for key in dict.fromkeys(name.rsplit("/", 1)[0] for name in cases):
    whole, documents = (rate(tokens, cases[f"{key}/{name}"].info["seconds"]) for name in ("whole", "documents"))
    results[key] = {"whole_tokens_per_s": whole, "documents_tokens_per_s": documents,
                    "ratio": documents["median"] / whole["median"]}
  return {"document_len": suite.document_len, "documents_per_batch": documents_per_batch, "cases": results}
