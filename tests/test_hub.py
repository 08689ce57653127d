"""jdr.runtime.hub: hub ids resolved through huggingface_hub's cache, offline, against a cache laid out as
huggingface_hub lays it out (models--owner--name/{blobs,refs,snapshots,trees}). Nothing here reaches the network:
the hub is offline, unreachable (a closed port on this machine), or stood in for by a function that raises its
errors."""

import hashlib
import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from jdr.runtime import hub

COMMIT = "0123456789abcdef0123456789abcdef01234567"
COMMIT_V2 = "89abcdef0123456789abcdef0123456789abcdef"
REPO = "castorini/ance-msmarco-passage"


def cache_repo(cache: pathlib.Path, repo_id: str, files: dict[str, str], commit: str = COMMIT,
               refs: tuple[str, ...] = ("main",), tree: list[str] | None = None) -> pathlib.Path:
  """Writes a snapshot as huggingface_hub does: each file's bytes in blobs/, the snapshot's files relative symlinks
  to them, refs/REF holding the commit (no newline), and with `tree` the listing snapshot_download caches
  (trees/COMMIT.json) of the repository's files, which it checks the snapshot against. Returns the snapshot."""
  folder = cache / ("models--" + repo_id.replace("/", "--"))
  snapshot = folder / "snapshots" / commit
  for name, text in files.items():
    data = text.encode()
    blob = folder / "blobs" / hashlib.sha1(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    link = snapshot / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
  for ref in refs:
    (folder / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
  if tree is not None:
    (folder / "trees").mkdir(parents=True, exist_ok=True)
    listing = {name: {"size": 1, "blob_id": hashlib.sha1(name.encode()).hexdigest()} for name in tree}
    (folder / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": listing}))
  return snapshot


MODEL_FILES = {"config.json": '{"model_type": "roberta"}', "model.safetensors": "tensors",
               "vocab.json": "{}", "merges.txt": "#version: 0.2"}


@pytest.fixture(autouse=True)
def no_lookups_carried_over():
  hub.forget()
  yield
  hub.forget()


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
  """An empty Hugging Face cache, offline. huggingface_hub read HF_HUB_CACHE and HF_HUB_OFFLINE into its
  constants when it was imported, so those are set too."""
  from huggingface_hub import constants
  cache = tmp_path / "hf" / "hub"
  cache.mkdir(parents=True)
  monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
  monkeypatch.setenv("HF_HUB_CACHE", str(cache))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  # And the hub's address a closed port here: anything that asks the hub anyway is refused at once.
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
  return cache


@pytest.fixture
def online(hf_cache, monkeypatch):
  """The same cache with offline mode off: the hub's address (a closed port) refuses at once, as on a machine
  without network."""
  from huggingface_hub import constants
  monkeypatch.delenv("HF_HUB_OFFLINE")
  monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
  return hf_cache


def one_line(error: BaseException) -> str:
  text = str(error)
  assert "\n" not in text, text
  return text


# ---------------------------------------------------------------------------------------------- names


@pytest.mark.parametrize("name, expected", [
    ("castorini/ance-msmarco-passage", True),
    ("sentence-transformers/msmarco-distilbert-base-tas-b", True),
    ("intfloat/e5-base-v2", True),
    ("BAAI/bge-small-en-v1.5", True),
    ("facebook/dpr-ctx_encoder-single-nq-base", True),
    ("castorini/ance-msmarco-passage@main", True),
    ("owner/name@0123456789abcdef0123456789abcdef01234567", True),
    ("owner/name@refs/pr/4", True),
    ("minilm", False),  # no owner: jdr's bundled model, or a local name
    ("bert-base-uncased", False),
    ("runs/nothere/x", False),  # two slashes: a path
    ("/abs/model", False),
    ("./runs/model", False),
    ("../runs/model", False),
    ("~/models/x", False),
    ("gs://bucket/model", False),
    ("s3://bucket/model", False),
    ("owner/", False),
    ("/name", False),
    ("owner//name", False),
    ("owner/na me", False),
    ("owner/-name", False),  # starts with a dash
    ("owner/name.", False),  # ends with a dot
    ("owner/na--me", False),
    ("owner/na..me", False),
    ("owner/name.git", False),
    ("owner/name@", False),
    ("owner/café", False),
    ("", False),
])
def test_looks_like_hub_id(name, expected):
  assert hub.looks_like_hub_id(name) is expected


def test_an_existing_path_shaped_like_an_id_is_a_path(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "runs" / "model").mkdir(parents=True)
  assert not hub.looks_like_hub_id("runs/model")
  assert hub.resolve("runs/model") == "runs/model"  # not sent to the hub
  assert hub.looks_like_hub_id("runs/other")


def test_paths_and_minilm_pass_through(hf_cache, tmp_path):
  local = tmp_path / "model"
  local.mkdir()
  (local / "config.json").write_text("{}")
  assert hub.resolve(str(local)) == str(local)
  assert hub.resolve(local) is local  # a pathlib.Path as it came
  assert hub.resolve(str(local / "config.json")) == str(local / "config.json")
  assert hub.resolve("minilm") == "minilm"
  assert hub.resolve("gs://bucket/models/tas-b") == "gs://bucket/models/tas-b"


@pytest.mark.parametrize("name", ["runs/nothere/x", "nothere", "./runs/model", "/no/such/model", "owner/na--me"])
def test_neither_a_path_nor_an_id(hf_cache, tmp_path, monkeypatch, name):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(FileNotFoundError) as error:
    hub.resolve(name)
  assert one_line(error.value) == f"{name}: no such directory, and not a Hugging Face hub id (owner/name)"


# ---------------------------------------------------------------------------------------------- the cache, offline


def test_a_cached_id_resolves_to_its_snapshot(hf_cache, capfd):
  snapshot = cache_repo(hf_cache, REPO, MODEL_FILES)
  path = hub.resolve(REPO)
  assert path == str(snapshot)
  assert (pathlib.Path(path) / "config.json").read_text() == MODEL_FILES["config.json"]
  assert json.loads((pathlib.Path(path) / "vocab.json").read_text()) == {}
  out, err = capfd.readouterr()
  assert (out, err) == ("", "")  # reading the cache draws no progress bar and warns nothing


def test_a_revision_after_at(hf_cache):
  cache_repo(hf_cache, REPO, MODEL_FILES)
  v2 = cache_repo(hf_cache, REPO, {**MODEL_FILES, "config.json": '{"model_type": "bert"}'}, commit=COMMIT_V2,
                  refs=("v2",))
  assert hub.resolve(f"{REPO}@v2") == str(v2)
  assert hub.resolve(f"{REPO}@{COMMIT_V2}") == str(v2)  # a commit needs no ref
  assert hub.resolve(f"{REPO}@main") == hub.resolve(REPO) != str(v2)


def test_missing_offline_is_one_line(hf_cache):
  with pytest.raises(FileNotFoundError) as error:
    hub.resolve(REPO)
  assert isinstance(error.value, hub.HubError)
  assert one_line(error.value) == (
      f"{REPO}: not in the Hugging Face cache (HF_HUB_OFFLINE is set; cache: {hf_cache}) — download it on a "
      "machine with internet or unset HF_HUB_OFFLINE")


def test_a_missing_revision_offline_names_it(hf_cache):
  cache_repo(hf_cache, REPO, MODEL_FILES)
  with pytest.raises(hub.HubError) as error:
    hub.resolve(f"{REPO}@v9")
  assert one_line(error.value).startswith(f"{REPO}@v9: not in the Hugging Face cache (HF_HUB_OFFLINE is set")


def test_offline_set_after_huggingface_hub_was_imported(hf_cache, monkeypatch):
  """HF_HUB_OFFLINE in the environment is enough, even where huggingface_hub's constant (read at its import)
  says online: jdr must not reach for the network then."""
  import huggingface_hub
  from huggingface_hub import constants
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
  monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda *a, **k: pytest.fail("asked the hub"))
  for value, offline in (("1", True), ("true", True), ("YES", True), ("0", False), ("", False)):
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    assert hub.offline() is offline
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  snapshot = cache_repo(hf_cache, REPO, MODEL_FILES)
  assert hub.resolve(REPO) == str(snapshot)
  monkeypatch.delenv("HF_HUB_OFFLINE")
  monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")  # huggingface_hub honours transformers' name too
  assert hub.offline()


# Files a sentence-transformers repository holds, as its tree listing names them; what jdr downloads of it is
# the last group (not the other runtimes' files, nor PyTorch weights beside safetensors).
ST_REPO = "sentence-transformers/msmarco-distilbert-base-tas-b"
ST_SKIPPED = ["tf_model.h5", "flax_model.msgpack", "rust_model.ot", "onnx/model.onnx", "onnx/config.json",
              "openvino/openvino_model.bin", "openvino/openvino_model.xml", "README.md", ".gitattributes",
              "pytorch_model.bin", "2_Dense/pytorch_model.bin"]
ST_KEPT = {"config.json": "{}", "model.safetensors": "t", "tokenizer.json": "{}", "tokenizer_config.json": "{}",
           "vocab.txt": "[PAD]", "special_tokens_map.json": "{}", "modules.json": "[]",
           "sentence_bert_config.json": "{}", "config_sentence_transformers.json": "{}",
           "1_Pooling/config.json": "{}", "2_Dense/config.json": "{}", "2_Dense/model.safetensors": "t"}


def test_a_snapshot_downloaded_with_the_patterns_is_found_offline(hf_cache):
  """huggingface_hub checks a cached snapshot against the cached listing of the repository, filtered by the
  patterns it is given: the lookup must give the ones the download was made with."""
  import huggingface_hub
  from huggingface_hub import errors
  snapshot = cache_repo(hf_cache, ST_REPO, ST_KEPT, tree=sorted([*ST_KEPT, *ST_SKIPPED]))
  assert hub.resolve(ST_REPO) == str(snapshot)
  # The check is live: without jdr's patterns the same snapshot is incomplete.
  with pytest.raises(errors.IncompleteSnapshotError):
    huggingface_hub.snapshot_download(ST_REPO, local_files_only=True, cache_dir=hf_cache)


def test_an_incomplete_snapshot_offline_is_one_line(hf_cache):
  kept = {k: v for k, v in ST_KEPT.items() if k != "vocab.txt"}
  snapshot = cache_repo(hf_cache, ST_REPO, kept, tree=sorted([*ST_KEPT, *ST_SKIPPED]))
  with pytest.raises(hub.HubError) as error:
    hub.resolve(ST_REPO)
  assert one_line(error.value) == (
      f"{ST_REPO}: the cached snapshot {snapshot} lacks vocab.txt, and HF_HUB_OFFLINE is set — complete it on a "
      "machine with internet or unset HF_HUB_OFFLINE")


def test_skipped_duplicates():
  files = ["config.json", "model.safetensors", "pytorch_model.bin", "2_Dense/pytorch_model.bin",
           "2_Dense/config.json", "big/model-00001-of-00002.safetensors", "big/pytorch_model-00001-of-00002.bin",
           "big/pytorch_model.bin.index.json", "big/model.safetensors.index.json", "old/pytorch_model.bin"]
  assert hub.skipped_duplicates(files) == ["big/pytorch_model-00001-of-00002.bin",
                                           "big/pytorch_model.bin.index.json", "pytorch_model.bin"]
  assert hub.skipped_duplicates(["pytorch_model.bin", "config.json"]) == []  # ANCE's: its only weights


# ---------------------------------------------------------------------------------------------- online


def test_unreachable_hub_falls_back_to_the_cache(online):
  snapshot = cache_repo(online, REPO, MODEL_FILES)
  assert hub.resolve(REPO) == str(snapshot)


def test_unreachable_hub_and_not_cached_is_one_line(online):
  with pytest.raises(hub.HubError) as error:
    hub.resolve(REPO)
  line = one_line(error.value)
  assert line.startswith(f"{REPO}: the Hugging Face hub cannot be reached (")
  assert line.endswith(f"and it is not in the cache ({online}) — check the network (HF_ENDPOINT, proxies) or "
                       "download it where the hub is reachable")


def _hub_answers(monkeypatch, error_class, status: int, message: str):
  """The hub stood in for: asking it about the repository raises `error_class` as huggingface_hub does."""
  import huggingface_hub
  from huggingface_hub import errors

  def refuse(*args, **kwargs):
    request = errors.Response(status, request=__import__("httpx2").Request("GET", "https://huggingface.co/api"))
    raise error_class(message, response=request)

  monkeypatch.setattr(huggingface_hub.HfApi, "model_info", refuse)
  monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)


@pytest.mark.parametrize("error, status, expected", [
    ("RepositoryNotFoundError", 404, f"{REPO}: no such local directory, and no such model on the Hugging Face hub "
                                     "(or a private one: log in with `hf auth login` or HF_TOKEN)"),
    ("GatedRepoError", 403, f"{REPO}: a gated repository — accept its conditions at https://huggingface.co/{REPO} "
                            "and log in (`hf auth login` or HF_TOKEN)"),
    ("HfHubHTTPError", 503, f"{REPO}: the Hugging Face hub answered HTTP 503 (HfHubHTTPError: Service Unavailable)"),
])
def test_hub_refusals_are_one_line(online, monkeypatch, error, status, expected):
  pytest.importorskip("httpx2")  # huggingface_hub 2's HTTP client, to build its errors
  from huggingface_hub import errors
  _hub_answers(monkeypatch, getattr(errors, error), status, "Service Unavailable\n\nRequest ID: abc")
  with pytest.raises(hub.HubError) as caught:
    hub.resolve(REPO)
  assert one_line(caught.value) == expected


def test_a_revision_the_hub_lacks(online, monkeypatch):
  pytest.importorskip("httpx2")
  from huggingface_hub import errors
  _hub_answers(monkeypatch, errors.RevisionNotFoundError, 404, "Revision Not Found")
  with pytest.raises(hub.HubError) as caught:
    hub.resolve(f"{REPO}@v9")
  assert one_line(caught.value) == f"{REPO}@v9: {REPO} has no revision 'v9' on the Hugging Face hub"


class _Info:
  """huggingface_hub's ModelInfo, as much of it as jdr reads."""
  sha = COMMIT
  files = [*ST_KEPT, *ST_SKIPPED]
  siblings = [type("Sibling", (), {"rfilename": name}) for name in files]


@pytest.mark.parametrize("already_cached", [True, False])
def test_a_download_asks_for_jdr_files_only(online, monkeypatch, already_cached):
  """What snapshot_download is asked for: jdr's files of the commit the hub names, and progress bars only when
  bytes will travel."""
  import huggingface_hub
  from huggingface_hub.utils import filter_repo_objects
  asked = {}
  if already_cached:
    cache_repo(online, ST_REPO, ST_KEPT)

  def download(**kwargs):
    asked.update(kwargs)
    return "/snapshot"

  monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo_id, revision=None: _Info())
  monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
  assert hub.resolve(ST_REPO) == "/snapshot"
  assert asked["repo_id"] == ST_REPO and asked["revision"] is None and not asked["local_files_only"]
  wanted = filter_repo_objects([*ST_KEPT, *ST_SKIPPED], allow_patterns=asked["allow_patterns"],
                               ignore_patterns=asked["ignore_patterns"])
  assert sorted(wanted) == sorted(ST_KEPT)
  assert (asked["tqdm_class"] is not None) is already_cached


def test_online_and_already_cached_draws_no_progress_bar(online, monkeypatch, capfd):
  """Online, a snapshot that holds every file: huggingface_hub goes through its download loop, finding each file
  in the cache (a commit named, its listing cached: nothing to ask the hub), and jdr's quiet bars draw nothing."""
  import huggingface_hub
  monkeypatch.setenv("TQDM_POSITION", "-1")  # huggingface_hub's bars drawn even on a stderr that is no terminal
  snapshot = cache_repo(online, ST_REPO, ST_KEPT, tree=sorted([*ST_KEPT, *ST_SKIPPED]))
  monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo_id, revision=None: _Info())
  assert hub.resolve(f"{ST_REPO}@{COMMIT}") == str(snapshot)
  assert capfd.readouterr() == ("", "")
  # What the same lookup draws with huggingface_hub's own bars.
  huggingface_hub.snapshot_download(ST_REPO, revision=COMMIT, allow_patterns=hub.ALLOW_PATTERNS,
                                    ignore_patterns=hub.IGNORE_PATTERNS + hub.skipped_duplicates([*_Info.files]))
  assert "Fetching 12 files" in capfd.readouterr().err


def test_resolved_from_the_environment_alone(hf_cache, tmp_path):
  """A fresh process configured only by the environment, as a user runs jdr: importing jdr.runtime.hub leaves
  huggingface_hub unimported, and HF_HUB_CACHE + HF_HUB_OFFLINE are what huggingface_hub reads at its import."""
  snapshot = cache_repo(hf_cache, REPO, MODEL_FILES)
  program = ("import sys; from jdr.runtime import hub; assert 'huggingface_hub' not in sys.modules; "
             f"print(hub.resolve({REPO!r})); hub.resolve('nobody/nothing')")
  env = {**os.environ, "HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1"}
  done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, check=False,
                        cwd=pathlib.Path(__file__).parent.parent, timeout=120)
  assert done.stdout == f"{snapshot}\n"
  assert done.stderr.strip().splitlines()[-1] == (
      f"jdr.runtime.hub.HubError: nobody/nothing: not in the Hugging Face cache (HF_HUB_OFFLINE is set; "
      f"cache: {hf_cache}) — download it on a machine with internet or unset HF_HUB_OFFLINE")
