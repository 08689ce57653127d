"""Hugging Face hub ids (`owner/name`, or `owner/name@revision`) as users type them, resolved to a local directory.

Wherever jdr takes a model (`--model`, `model.init_from`, a tokenizer), a name that is not an existing path may be a
hub id: it is looked up in huggingface_hub's own cache (HF_HUB_CACHE / HF_HOME), downloaded there where the machine
reaches the hub, and read from the cache alone under HF_HUB_OFFLINE=1, as transformers does. When that fails the
error is one line that names the id and the reason (not in the cache and offline, no such repository, gated, the
network), a `HubError`, which is a FileNotFoundError (an OSError: the command lines print it as `error: ...`).

huggingface_hub is imported inside the functions: it pulls in an HTTP client, and most runs name local directories.
"""

import functools
import os
import re

from jdr.runtime import paths

# What jdr reads of a published model (jdr.models.hf, .published, jdr.data.text): configs and sentence-transformers'
# module files (*.json), safetensors or PyTorch weights (top level and modules such as 2_Dense/), and tokenizer
# files (vocab.txt, merges.txt, spiece.model). Nothing else a repository may hold is downloaded (TF's *.h5, Flax's
# *.msgpack, Rust's *.ot, ONNX, OpenVINO, GGUF, training state): in many repositories it is most of the bytes.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*pytorch_model*.bin", "*.txt", "*.model"]
# And of what those allow: the other runtimes' folders (their configs and tokenizers are copies) and Mistral-style
# consolidated.safetensors (the model-*.safetensors tensors again). `*` crosses `/` in huggingface_hub's patterns.
IGNORE_PATTERNS = ["onnx/*", "*/onnx/*", "openvino/*", "*/openvino/*", "coreml/*", "*/coreml/*",
                   "consolidated*.safetensors"]

# huggingface_hub's own rule (utils/_validators.py): each part 1-96 of [A-Za-z0-9_.-], starting and ending with a
# letter, digit or `_`; no `--` or `..`; not ending in `.git`. A revision (branch, tag, commit, refs/pr/N) after `@`.
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"(?P<repo>{_PART}/{_PART})(?:@(?P<revision>[^\s@]+))?")


class HubError(FileNotFoundError):
  """A hub id that could not be resolved; the text is one line: `ID: reason`."""


def looks_like_hub_id(name: str) -> bool:
  """Whether `name` reads as `owner/name[@revision]` and is not a local or remote path: an existing path, an
  absolute one, one starting with ./ ../ or ~, or a URL (gs://...) is a path whatever its shape."""
  if not name or os.path.isabs(name) or name.startswith(("./", "../", "~")) or not paths.is_local(name):
    return False
  if os.path.exists(name):
    return False
  match = _HUB_ID.fullmatch(name)
  if not match:
    return False
  repo = match["repo"]
  return "--" not in repo and ".." not in repo and not repo.endswith(".git")


def resolve(name: str) -> str:
  """A model name as a user types it -> what to read: `minilm`, an existing local path and a remote (gs://) path
  unchanged; a hub id -> its snapshot directory in the Hugging Face cache (downloaded if needed and allowed)."""
  text = os.fspath(name)
  if text == "minilm" or not paths.is_local(text) or os.path.exists(text):
    return name
  if not looks_like_hub_id(text):
    raise FileNotFoundError(f"{text}: no such directory, and not a Hugging Face hub id (owner/name)")
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  match = _HUB_ID.fullmatch(text)
  return _snapshot(text, match["repo"], match["revision"], constants.HF_HUB_CACHE, offline())


def offline() -> bool:
  """huggingface_hub's HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), parsed its way. Read again from the environment
  too: huggingface_hub reads it once, at import, and a process (a notebook, a test) may set it after that."""
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  now = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
  return bool(constants.HF_HUB_OFFLINE) or now.upper() in constants.ENV_VARS_TRUE_VALUES


def skipped_duplicates(files: list[str]) -> list[str]:
  """The PyTorch weights (and their shard index) of each folder that also has safetensors: the same tensors
  twice, and jdr reads the safetensors. A function of the repository's file list alone, so the download and a
  later offline lookup (huggingface_hub checks a cached snapshot against the cached list and these patterns)
  skip the same files."""
  with_safetensors = {os.path.dirname(f) for f in files if f.endswith(".safetensors")}
  return sorted(f for f in files if os.path.dirname(f) in with_safetensors and
                re.fullmatch(r"pytorch_model.*\.bin(\.index\.json)?", os.path.basename(f)))


def forget() -> None:
  """Drops the lookups this process remembered (a test changing the cache or the offline setting)."""
  _snapshot.cache_clear()


# One lookup per id, cache folder and mode in a process: a model and its tokenizer name the same id, and online
# each lookup asks the hub for the repository's files.
@functools.lru_cache(maxsize=None)
def _snapshot(name: str, repo_id: str, revision: str | None, cache: str, offline_: bool) -> str:
  import huggingface_hub  # pylint: disable=g-import-not-at-top
  from huggingface_hub import errors  # pylint: disable=g-import-not-at-top
  commit, files = (None, None) if offline_ else _listing(repo_id, revision)
  if files is None:  # offline, or the hub did not answer: the listing cached with the snapshot, if any
    try:
      files = [f.path for f in huggingface_hub.get_cached_repo_tree(repo_id, revision=revision, cache_dir=cache)]
    except (errors.CachedRepoTreeNotFoundError, OSError, ValueError):
      files = []  # none cached (nothing downloaded, or a snapshot transformers fetched file by file): no check
  ignore = IGNORE_PATTERNS + skipped_duplicates(files)
  # Progress bars only for bytes that travel: offline, and online when the snapshot of the hub's commit already
  # holds every wanted file, huggingface_hub only reads its cache.
  wanted = list(huggingface_hub.utils.filter_repo_objects(files, allow_patterns=ALLOW_PATTERNS,
                                                          ignore_patterns=ignore))
  snapshot = os.path.join(cache, "models--" + repo_id.replace("/", "--"), "snapshots", commit or "")
  cached = bool(commit and wanted) and all(os.path.exists(os.path.join(snapshot, f)) for f in wanted)
  try:
    return huggingface_hub.snapshot_download(
        repo_id=repo_id, revision=revision, cache_dir=cache, local_files_only=offline_,
        allow_patterns=ALLOW_PATTERNS, ignore_patterns=ignore, tqdm_class=_quiet() if offline_ or cached else None)
  except Exception as e:  # pylint: disable=broad-except
    if not _users_to_fix(e):
      raise
    raise HubError(_reason(name, repo_id, revision, cache, offline_, e)) from e


def _listing(repo_id: str, revision: str | None) -> tuple[str | None, list[str] | None]:
  """The commit `revision` is at and its files, from the hub (one request); (None, None) when the hub does not
  answer: snapshot_download then meets the same error and falls back to the cache or reports it."""
  import huggingface_hub  # pylint: disable=g-import-not-at-top
  try:
    # A new HfApi, as snapshot_download makes: it reads HF_ENDPOINT's constant now (the module's default one read it
    # at import).
    info = huggingface_hub.HfApi().model_info(repo_id, revision=revision)
  except Exception as e:  # pylint: disable=broad-except
    if not _users_to_fix(e):
      raise
    return None, None
  return info.sha, [s.rfilename for s in info.siblings or []]


def _reason(name: str, repo_id: str, revision: str | None, cache: str, offline_: bool, e: Exception) -> str:
  """One line: `NAME: why`, for an error huggingface_hub raised resolving `repo_id`."""
  from huggingface_hub import errors  # pylint: disable=g-import-not-at-top
  cause = e.__cause__ or e.__context__
  if isinstance(e, errors.IncompleteSnapshotError):
    missing = re.search(r"missing \((.*?)\)\.", str(e))
    what = f"lacks {missing[1]}" if missing else "is incomplete"
    why = ("HF_HUB_OFFLINE is set — complete it on a machine with internet or unset HF_HUB_OFFLINE" if offline_
           else f"the hub cannot be reached ({_first_line(cause)}) — check the network")
    return f"{name}: the cached snapshot {e.snapshot_path} {what}, and {why}"
  if isinstance(e, errors.LocalEntryNotFoundError) and (offline_ or isinstance(cause, errors.OfflineModeIsEnabled)):
    return (f"{name}: not in the Hugging Face cache (HF_HUB_OFFLINE is set; cache: {cache}) — download it on a "
            "machine with internet or unset HF_HUB_OFFLINE")
  if isinstance(e, errors.LocalEntryNotFoundError):
    return (f"{name}: the Hugging Face hub cannot be reached ({_first_line(cause)}) and it is not in the cache "
            f"({cache}) — check the network (HF_ENDPOINT, proxies) or download it where the hub is reachable")
  if isinstance(e, errors.GatedRepoError):
    return (f"{name}: a gated repository — accept its conditions at https://huggingface.co/{repo_id} and log in "
            "(`hf auth login` or HF_TOKEN)")
  if isinstance(e, errors.RepositoryNotFoundError):
    return (f"{name}: no such local directory, and no such model on the Hugging Face hub (or a private one: log in "
            "with `hf auth login` or HF_TOKEN)")
  if isinstance(e, errors.RevisionNotFoundError):
    return f"{name}: {repo_id} has no revision {revision!r} on the Hugging Face hub"
  if isinstance(e, errors.HfHubHTTPError) and getattr(e.response, "status_code", None):
    return f"{name}: the Hugging Face hub answered HTTP {e.response.status_code} ({_first_line(e)})"
  return f"{name}: could not download it from the Hugging Face hub ({_first_line(e)})"


def _first_line(e: BaseException | None) -> str:
  if e is None:
    return "no reason given"
  lines = str(e).strip().splitlines()
  text = lines[0] if lines else ""
  text = text if len(text) <= 200 else text[:197] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _users_to_fix(e: Exception) -> bool:
  """An error of the hub, the network or the disk, not a bug: OSErrors (huggingface_hub's HTTP and cache errors
  are) and whatever huggingface_hub and its HTTP client raise of their own (httpx's errors, a Xet download's)."""
  return isinstance(e, (OSError, ValueError)) or type(e).__module__.split(".")[0] in (
      "huggingface_hub", "httpx", "httpx2", "requests", "urllib3")


@functools.cache
def _quiet() -> type:
  """A progress bar class that never draws (huggingface_hub draws its own unless given one)."""
  import tqdm  # pylint: disable=g-import-not-at-top

  class Quiet(tqdm.tqdm):

    def __init__(self, *args, **kwargs):
      kwargs.pop("name", None)
      super().__init__(*args, **{**kwargs, "disable": True})

  return Quiet
