"""The `model` section of a config, typed per architecture (`RetNetConfig`, `TransformerConfig`), checked once when
built: its fields, its mixers' fields (`architectures.check_config`), the layers they build.

    cfg = model_config.of(config.model)   # the user's section, a config.json dict, or a section already built
    model = Model(cfg, rngs=nnx.Rngs(0))  # Model takes either; it builds the section once

A RetNet's mixers read their own sections: `retention` (`model.decay_*`), `gated_retention` (`model.gate_*`),
`attention` (a hybrid's `model.attention_*`), which the user's config and config.json hold flat, by those names
(`sections.Section.FLAT_PREFIX`); a mixer's section that no layer reads must stay at its defaults
(`architectures.check_config` says why).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from retnet_jax.core import sections
from retnet_jax.mixers.attention import HybridAttentionConfig
from retnet_jax.mixers.gated_retention import GatedRetentionConfig
from retnet_jax.mixers.multiscale_retention import RetentionConfig
from retnet_jax.models import architectures

field = sections.field


@dataclasses.dataclass(frozen=True, kw_only=True)
class Common(sections.Section):
  """The fields of both architectures' model sections."""
  architecture: str = field("retnet (configs/retnet.py) | transformer (configs/transformer.py)")
  vocab_size: int = field("tokens of the vocabulary (embedding rows and output logits)")
  d_model: int = field("model width")
  num_layers: int = field("blocks")
  num_heads: int = field("query heads of each mixer")
  ffn_dim: int = field("the GLU FFN's hidden width")
  ffn_activation: str = field("gelu (exact) | gelu_tanh | swish | relu")
  tie_embeddings: bool = field("the output projection is the embedding's transpose")
  rotation_base: float = field("the rotations' (xPos / RoPE) base")
  rotation_freqs: str = field("linspace: base^(-j/(d_k/2-1)) (torchscale) | rope: base^(-2j/d_k) (fla)")
  norm_eps: float = field("block, final and embedding RMSNorm epsilon")
  dtype: str = field("compute dtype: float32 | bfloat16; training keeps float32 parameters")
  param_dtype: str = field("the weights' dtype outside training (evaluation, generation, export): float32 | "
                           "bfloat16 (half the weight reads of decoding)")
  matmul_precision: str = field("every matmul's precision: default (on GPUs float32 runs in TF32) | high | highest "
                                "(exact float32)")
  scan_layers: bool = field("the blocks' parameters stacked on a leading layer axis and run under a scan: compile "
                            "time independent of depth, the same function; checkpoints restore across the two "
                            "layouts")

  ARCHITECTURE: typing.ClassVar[str]  # model.architecture's value for this section

  def __post_init__(self):
    architectures.check_config(self)

  @classmethod
  def misfit(cls, where: str, unknown: list[str], missing: list[str]) -> str:
    """The section's names against another architecture's: those it lacks, and the foreign ones."""
    name = cls.ARCHITECTURE
    parts = ([f"it lacks {', '.join('model.' + k for k in sorted(missing))}"] if missing else []) + (
        [f"{', '.join('model.' + k for k in unknown)} are not {name} fields"] if unknown else [])
    return (f"model.architecture={name!r} does not fit this model section ({'; '.join(parts)}); take the whole "
            f"section from configs/{name}.py, e.g. --config=configs/{name}.py:small.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetNetConfig(Common):
  """`config.model` of a RetNet (configs/retnet.py), hybrids included."""
  ARCHITECTURE = "retnet"
  mixer: str = field("every layer's token mixer but attention_layers' (`architectures.MIXERS`): retention | "
                     "gated_retention (YOCO's per-token decay)")
  num_kv_heads: int | None = field("key/value heads, each shared by num_heads / num_kv_heads query heads; None: "
                                   "num_heads")
  value_dim: int = field("total value width (all heads); the paper uses 2 x d_model")
  chunk_size: int = field("chunk length of the chunkwise form")
  rotation_pairs: str = field("interleaved: features (2j, 2j+1) (torchscale) | half: (j, j + d_k/2) (fla)")
  stability_norm: bool = field("retention: divide raw retention by sqrt(sum of decays) and the clamped score sum")
  stability_norm_style: str = field("shared: one scalar that every form computes alike (forms agree exactly) | "
                                    "torchscale: the official code's per-form scalars")
  head_norm_eps: float = field("per-head RMSNorm epsilon")
  head_norm_scale: bool = field("a learned scale in the per-head RMSNorm, shared by all heads (fla)")
  scale_embedding: bool = field("multiply token embeddings by sqrt(d_model)")
  embed_norm: bool = field("RMSNorm on the embeddings before the first block")
  retention_impl: str = field("the chunkwise form: xla (einsums) | pallas (fused kernels, GPU) | auto (pallas "
                              "where it compiles, else xla)")
  kernel_layout: str = field("the Pallas kernels' layout: split (a state pass, then chunk-parallel kernels) | "
                             "fused (one pass over the chunks per head)")
  retention: RetentionConfig = field("multi-scale retention's own fields (`model.decay_*`)")
  gated_retention: GatedRetentionConfig = field("gated retention's own fields (`model.gate_*`)")
  attention: HybridAttentionConfig = field("the hybrid's attention layers (`model.attention_*`)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig(Common):
  """`config.model` of the Transformer of a preset's size (configs/transformer.py)."""
  ARCHITECTURE = "transformer"
  max_len: int = field("KV-cache length: the longest prompt + generation a decoding state holds")


CLASSES: dict[str, type[Common]] = {cls.ARCHITECTURE: cls for cls in (RetNetConfig, TransformerConfig)}
ModelConfig = RetNetConfig | TransformerConfig


def of(cfg: Any) -> ModelConfig:
  """The typed model section of `cfg` (the user's model section or a dict of its fields; a section is returned
  as it is), checked; ValueError naming the bad value and the fix, TypeError for something other than the model
  fields."""
  if isinstance(cfg, Common):
    return cfg
  if not hasattr(cfg, "items") or "d_model" not in cfg:
    full = hasattr(cfg, "items") and "model" in cfg
    raise TypeError("a model takes the model fields, config.model (e.g. presets.model_config('tiny')); got "
                    + ("the full config: pass config.model." if full else f"a {type(cfg).__name__}."))
  return CLASSES[architectures.architecture(cfg.get("architecture"))].of(cfg, "model")
