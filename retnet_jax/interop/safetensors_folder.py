"""A Hugging Face checkpoint folder of safetensors files (`model.safetensors`, or shards named by
`model.safetensors.index.json`), read tensor by tensor with numpy: no torch, and no file left mapped.

    folder = SafetensorsFolder(Path("checkpoints/retnet"))
    folder.specs["lm_head.weight"]  # (file, shape, dtype) from the file headers
    folder.read("lm_head.weight")   # float32 numpy, refused if not finite
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

DTYPES = {"F32", "BF16", "F16"}  # the dtypes a tensor may be stored in
INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"


def listing(names: list[str], limit: int = 12) -> str:
  """`names` joined for an error message, the first `limit` of them."""
  shown = ", ".join(names[:limit])
  return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


class SafetensorsFolder:
  """The tensors of a Hugging Face checkpoint folder (`model.safetensors`, or the shards its index names), as
  numpy: names, shapes and dtypes from the file headers; each tensor read on request, its file opened for it
  alone so that no file stays mapped."""

  def __init__(self, folder: Path):
    self.folder = folder
    if (folder / INDEX_FILE).is_file():
      try:
        index = json.loads((folder / INDEX_FILE).read_text())
      except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{folder / INDEX_FILE} is not valid JSON ({e}); the checkpoint is damaged or truncated: "
                         "copy or download its index again.") from None
      weight_map = index.get("weight_map") if isinstance(index, dict) else None
      if not isinstance(weight_map, dict):
        raise ValueError(f"{folder / INDEX_FILE} has no weight_map (tensor name -> shard file); the checkpoint is "
                         "damaged or truncated: copy or download its index again.")
      files = sorted(set(weight_map.values()))
    elif (folder / SINGLE_FILE).is_file():
      weight_map, files = None, [SINGLE_FILE]
    else:
      other = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
      raise FileNotFoundError(f"{folder} holds no {SINGLE_FILE} nor {INDEX_FILE}" + (
          f" (only {listing(other)}: load it with transformers and save_pretrained it as safetensors)" if other
          else "; point --checkpoint at the folder of an fla RetNet checkpoint."))
    self.specs: dict[str, tuple[str, tuple[int, ...], str]] = {}  # name -> (file, shape, dtype)
    for file in files:
      if not (folder / file).is_file():
        raise FileNotFoundError(f"{folder / file}, a shard that {INDEX_FILE} names, is missing.")
      with opened(folder / file) as f:
        for name in f.keys():
          tensor = f.get_slice(name)
          self.specs[name] = (file, tuple(tensor.get_shape()), tensor.get_dtype())
    if weight_map is not None:
      misplaced = sorted(name for name, file in weight_map.items() if self.specs.get(name, (file,))[0] != file)
      if misplaced:
        raise ValueError(f"{INDEX_FILE} places tensors in shards that do not hold them: {listing(misplaced)}.")

  def read(self, name: str) -> np.ndarray:
    """The tensor `name` as float32 (bfloat16 via ml_dtypes, which jax provides), refused if not finite."""
    path = self.folder / self.specs[name][0]
    with opened(path) as f:
      try:
        tensor = np.asarray(f.get_tensor(name), np.float32)
      except SafetensorError as e:
        raise ValueError(f"{path}: the tensor {name} is unreadable ({e}); the file is damaged or truncated: "
                         "download or save it again.") from None
    if not np.isfinite(tensor).all():
      raise ValueError(f"{path}: the tensor {name} holds {np.size(tensor) - np.isfinite(tensor).sum()} NaN or "
                       "infinite values; the checkpoint is damaged (or diverged): use another.")
    return tensor


@contextlib.contextmanager
def opened(path: Path) -> Iterator[Any]:
  """`safe_open(path)`, a damaged file (empty, truncated, not safetensors) refused by name."""
  try:
    handle = safe_open(path, framework="np")
  except SafetensorError as e:
    raise ValueError(f"{path} is not a readable safetensors file ({e}); it is damaged or truncated: download or "
                     "save it again.") from None
  with handle as f:
    yield f
