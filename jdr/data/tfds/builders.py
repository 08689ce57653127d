"""TFDS builders that turn a local BEIR / MS MARCO directory (the `manual_dir`) into `array_record` files.

Two builders, because TFDS gives a dataset one feature spec for all its splits and pairs and documents have
different fields:

  jdr_pairs/<name>    one split per qrels file (train, test, dev, ...); an example per positive qrels pair:
                      query_id, query, doc_id, title, text (str) and relevance (int32)
  jdr_corpus/<name>   one split "corpus"; an example per document: doc_id, title, text

The config name is the dataset's name ("scifact", "msmarco", ...). Any valid name is accepted without being
listed in BUILDER_CONFIGS, so `tfds.data_source("jdr_pairs/scifact", data_dir=...)` works once this module is
imported. Examples keep the source files' order (`disable_shuffling`): index i of the data source is the i-th
example that `source.examples_from_source` returns, so shuffling is the trainer's job, with its own seed.

Nothing here needs TensorFlow: generation is pure Python, the files are array_record, and reading goes through
`as_data_source` (random access, numpy/bytes). The usual entry points are `prepare` and the loaders in
`jdr.data.tfds`, which wrap these classes.
"""

import re
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds

from jdr.data.tfds import source

VERSION = tfds.core.Version("1.0.0")
FILE_FORMAT = tfds.core.FileFormat.ARRAY_RECORD

# The config-name part of TFDS's dataset-name regex; the name becomes a directory.
_CONFIG_NAME = re.compile(r"^[\w+\-.]+$")

_INSTRUCTIONS = f"""\
Point `manual_dir` (or `jdr.data.tfds.prepare(source_dir, ...)`) at the dataset's local directory.
{source.LAYOUT_HELP}"""


def check_name(name: str) -> str:
  if not isinstance(name, str) or not _CONFIG_NAME.match(name):
    raise ValueError(f"dataset name {name!r} must be non-empty letters, digits, '_', '-', '.' or '+' "
                     "(it names a TFDS config and a directory)")
  return name


class _LocalSourceBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Shared parts: any config name, manual_dir only, array_record files, file order kept, source fingerprint."""

  VERSION = VERSION
  RELEASE_NOTES = {"1.0.0": "First release."}
  MANUAL_DOWNLOAD_INSTRUCTIONS = _INSTRUCTIONS
  _DESCRIPTION: ClassVar[str] = ""
  _FEATURES: ClassVar[dict]
  # Synthesised configs, one object per name: TFDS checks a config passed as an object by identity against
  # what `get_builder_config` returns for its name.
  _dynamic_configs: ClassVar[dict[str, tfds.core.BuilderConfig]]

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    cls._dynamic_configs = {}

  def __init__(self, *, skip_invalid: bool = False, file_format=FILE_FORMAT, **kwargs):
    # skip_invalid is forwarded to jdr.data.formats: drop bad records (with a printed count) instead of failing.
    self._skip_invalid = skip_invalid
    super().__init__(file_format=file_format, **kwargs)

  @classmethod
  def get_builder_config(cls, name: str, version=None) -> tfds.core.BuilderConfig | None:
    if (config := super().get_builder_config(name, version)) is not None:
      return config
    if name not in cls._dynamic_configs:
      check_name(name)
      cls._dynamic_configs[name] = tfds.core.BuilderConfig(
          name=name, version=VERSION, description=f"{name} read from a local directory (manual_dir)")
    return cls._dynamic_configs[name]

  def _info(self) -> tfds.core.DatasetInfo:
    # DatasetInfo directly rather than `dataset_info_from_configs`: the latter reads CITATIONS.bib / README.md
    # metadata from the builder's package via importlib resources, which jdr does not ship.
    return tfds.core.DatasetInfo(
        builder=self,
        description=self._DESCRIPTION,
        features=tfds.features.FeaturesDict(self._FEATURES),
        # The source fingerprint lands in metadata.json, so `prepare` can tell a stale dataset from a fresh one.
        metadata=tfds.core.MetadataDict(),
        disable_shuffling=True,
    )

  def _layout(self, dl_manager) -> source.Layout:
    layout = source.find_layout(dl_manager.manual_dir)
    self.info.metadata["source"] = source.fingerprint(layout, skip_invalid=self._skip_invalid)
    return layout


class JdrPairs(_LocalSourceBuilder):
  """Positive (query, document) pairs, one split per qrels file of the source directory."""

  _DESCRIPTION = ("Positive (query, document) pairs of a local BEIR / MS MARCO dataset: one example per qrels "
                  "line with relevance > 0, in file order, grouped by query.")
  _FEATURES = {
      "query_id": tfds.features.Text(),
      "query": tfds.features.Text(),
      "doc_id": tfds.features.Text(),
      "title": tfds.features.Text(),
      "text": tfds.features.Text(),
      "relevance": tfds.features.Scalar(dtype=np.int32),
  }

  def _split_generators(self, dl_manager):
    layout = self._layout(dl_manager)
    pairs = source.read_pairs(layout, skip_invalid=self._skip_invalid)
    return {split: self._generate_examples(examples) for split, examples in pairs.items()}

  def _generate_examples(self, examples):
    # Integer keys in generation order; with disable_shuffling the files keep this order.
    yield from enumerate(examples)


class JdrCorpus(_LocalSourceBuilder):
  """The documents of a local BEIR / MS MARCO dataset, in one split named "corpus"."""

  _DESCRIPTION = "The corpus of a local BEIR / MS MARCO dataset: one example per document, in file order."
  _FEATURES = {
      "doc_id": tfds.features.Text(),
      "title": tfds.features.Text(),
      "text": tfds.features.Text(),
  }

  def _split_generators(self, dl_manager):
    layout = self._layout(dl_manager)
    return {"corpus": self._generate_examples(layout)}

  def _generate_examples(self, layout):
    # Streamed: the corpus is never held in memory as a whole.
    yield from enumerate(source.iter_docs(layout, skip_invalid=self._skip_invalid))
