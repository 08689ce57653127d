"""data.mixture (jdr/data/mixture.py): the grammar and its refusals, the schedule against an independent numpy
sampler, one dataset a batch, each dataset's own negatives and in-batch choice in `valid`, and a run resumed
mid-mixture bitwise equal to an uninterrupted one."""

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest

from conftest import write_tiny_beir
from jdr.data import formats
from jdr.data import mixture
from jdr.data import pairs
from jdr.data import text as text_lib
from jdr.negatives import sampled
from jdr.negatives import sources
from jdr.runtime import config_files

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCK = 1024  # the documented block of the proportional draw: numpy's Generator seeded [seed, block, 4]


def _independent_draw(weights, seed: int, steps: int) -> np.ndarray:
  """The documented proportional draw, written with numpy's own weighted sampler (`Generator.choice`)."""
  p = np.asarray(weights, np.float64) / np.sum(weights)
  blocks = [np.random.default_rng([seed, b, 4]).choice(len(p), size=BLOCK, p=p) for b in range(-(-steps // BLOCK))]
  return np.concatenate(blocks)[:steps]


def _earlier_counts(drawn: np.ndarray) -> np.ndarray:
  """For each step, how many earlier steps drew the same dataset."""
  out, seen = np.zeros(len(drawn), np.int64), {}
  for s, i in enumerate(drawn.tolist()):
    out[s], seen[i] = seen.get(i, 0), seen.get(i, 0) + 1
  return out


# ------------------------------------------------------------------------------------------------ the schedule


def test_proportional_draw_is_the_independent_numpy_sampler():
  weights, seed, steps = [2.0, 1.0, 0.5], 7, 3 * BLOCK + 100  # across block boundaries
  schedule = mixture.Schedule(weights, "proportional", seed)
  expected = _independent_draw(weights, seed, steps)
  got = [schedule.position(s) for s in range(steps)]
  assert [i for i, _ in got] == expected.tolist()  # the exact sequence
  assert [j for _, j in got] == _earlier_counts(expected).tolist()  # each dataset's own batch index
  assert schedule.counts(steps).tolist() == np.bincount(expected, minlength=3).tolist()
  # A fresh schedule (a resumed run) finds any step's position without the earlier ones asked for.
  for s in (steps - 1, 2 * BLOCK + 5, BLOCK, 17):
    assert mixture.Schedule(weights, "proportional", seed).position(s) == got[s]
  # Another seed, another sequence.
  assert mixture.Schedule(weights, "proportional", seed + 1).counts(steps).tolist() != \
      schedule.counts(steps).tolist()


def test_proportional_frequencies_follow_the_weights():
  weights, n = [3.0, 1.0, 1.0], 40_000
  counts = mixture.Schedule(weights, "proportional", 0).counts(n)
  p = np.asarray(weights) / sum(weights)
  sigma = np.sqrt(p * (1 - p) / n)
  assert np.all(np.abs(counts / n - p) < 4 * sigma), (counts / n, p)


def test_round_robin_order():
  equal = mixture.Schedule([1.0, 1.0, 1.0], "round_robin", 0)
  assert [equal.position(s)[0] for s in range(2 * BLOCK + 3)] == [s % 3 for s in range(2 * BLOCK + 3)]
  assert [equal.position(s)[1] for s in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
  two_to_one = mixture.Schedule([2.0, 1.0], "round_robin", 5)  # the seed does not matter
  assert [two_to_one.position(s)[0] for s in range(9)] == [0, 1, 0] * 3
  # Any weights: after n steps each dataset has had its share to within one step.
  weights = np.array([3.0, 1.0, 1.5])
  schedule = mixture.Schedule(weights, "round_robin", 0)
  drawn = np.array([schedule.position(s)[0] for s in range(BLOCK + 200)])
  for n in range(1, len(drawn) + 1, 37):
    assert np.all(np.abs(np.bincount(drawn[:n], minlength=3) - n * weights / weights.sum()) < 1.0), n
  assert [schedule.position(s)[1] for s in range(len(drawn))] == _earlier_counts(drawn).tolist()
  assert mixture.Schedule(weights, "round_robin", 0).position(BLOCK + 150) == schedule.position(BLOCK + 150)


# ------------------------------------------------------------------------------------------------ the grammar


def test_the_grammar():
  entries = mixture.parse(
      "gs://bucket/scifact:weight=2,negatives=bm25 ; data/nq : in_batch=0, prompt='query: a, b; c:' ,split=dev;"
      " builtin:prompt=\"it's\",name=docs,source=tfds;")
  assert [(e.dataset, e.name) for e in entries] == [("gs://bucket/scifact", "scifact"), ("data/nq", "nq"),
                                                    ("builtin", "docs")]
  assert (entries[0].weight, entries[0].negatives, entries[0].in_batch) == (2.0, "bm25", None)
  assert (entries[1].weight, entries[1].in_batch, entries[1].prompt, entries[1].split) == \
      (1.0, False, "query: a, b; c:", "dev")
  assert (entries[2].prompt, entries[2].source) == ("it's", "tfds")
  assert mixture.parse("") == [] and mixture.parse(" ; ") == []
  # The command line hands the string over verbatim.
  config = config_files.load_config_file(str(ROOT / "configs" / "demo.py") + ":tiny")
  text = "a:weight=2,prompt='q: x, y';b:in_batch=off"
  config_files.apply_overrides(config, [f"data.mixture={text}"])
  assert config.data.mixture == text and [e.prompt for e in mixture.parse(config.data.mixture)] == ["q: x, y", ""]


@pytest.mark.parametrize("text,number,reason", [
    ("a:weight=0", 1, "weight='0': must be a finite number > 0"),
    ("a;b:weight=-1", 2, "must be a finite number > 0"),
    ("a:weight=nan", 1, "must be a finite number > 0"),
    ("a:weight=two", 1, "is not a number"),
    ("a:wieght=2", 1, "unknown option 'wieght' (did you mean weight?)"),
    ("a:weight=2,weight=3", 1, "weight is given twice"),
    ("a:in_batch=maybe", 1, "in_batch='maybe': expected 1 or 0"),
    ("a:source=hdf5", 1, "source='hdf5': expected files or tfds"),
    ("a;b:prompt='q: ", 2, "the quote ' is never closed"),
    ("a:prompt='q' x", 1, "expected ',' or ';' after the quoted value"),
    ("a:weight=2,", 1, "expected key=value"),
    (":weight=2", 1, "no dataset before the ':'"),
    ("a:b", 1, "the ':' after the dataset starts its options"),
    ("a:name=x/y", 1, "name 'x/y'"),
])
def test_a_bad_entry_is_one_line_naming_it_and_the_reason(text, number, reason):
  with pytest.raises(mixture.MixtureError) as e:
    mixture.parse(text)
  message = str(e.value)
  assert "\n" not in message and message.startswith(f"data.mixture entry {number} (") and reason in message, message


def _config(*overrides):
  config = config_files.load_config_file(str(ROOT / "configs" / "demo.py") + ":tiny")
  config_files.apply_overrides(config, list(overrides))
  return config


def test_plan_gives_each_dataset_its_own_run(tmp_path):
  a, b = write_tiny_beir(tmp_path / "a"), write_tiny_beir(tmp_path / "b", num_docs=24, seed=1)
  config = _config("negatives.source=random", "negatives.per_query=2", "seed=3",
                   f"data.mixture={a}:weight=2;{b}:negatives=none,prompt='q: ',split=test,in_batch=1")
  first, second = mixture.plan(config, sources.SAMPLERS, sources.check)
  assert (first.config.data.dataset, first.config.data.eval_split, first.config.seed) == (str(a), "test", 3)
  assert (first.config.negatives.source, first.config.negatives.per_query, first.padding_per_query) == ("random", 2, 0)
  assert (second.config.data.dataset, second.config.data.train_split, second.config.data.eval_split) == \
      (str(b), "test", "")
  assert (second.config.negatives.source, second.config.negatives.per_query, second.padding_per_query) == \
      ("none", 0, 2)
  assert second.config.seed == 4 and second.config.data.mixture == "" and config.data.mixture  # a copy
  assert second.prompts({"query": "", "doc": "d: "}) == {"query": "q: ", "doc": "d: "}
  assert first.prompts({"query": "", "doc": "d: "}) == {"query": "", "doc": "d: "}
  assert mixture.plan(_config(), sources.SAMPLERS, sources.check) == []


@pytest.mark.parametrize("entries,overrides,reason", [
    ("{a};{a}", [], "the name 'a' is entry 1's too; set name=..."),
    ("{a};{missing}", [], "directory not found"),
    ("{a};{b}:negatives=ance", [], "negatives='ance': a mixture's datasets take the sources sampled"),
    ("{a};{b}:negatives=retrieval", [], "negatives='retrieval'"),
    ("{a};{b}:negatives=bogus", [], "negatives='bogus'"),
    ("{a};{b}:in_batch=0", [], "in_batch=0 with no negatives source"),
    ("{a};{b}:negatives=bm25", [], "needs negatives.per_query >= 1"),  # the negatives' own check, on the entry
    ("{a};{b}:negatives=mined", ["negatives.source=random", "negatives.per_query=1"], "needs its file: mined="),
    ("{a};{b}:negatives=static", ["negatives.source=random", "negatives.per_query=1"], "static_run=..."),
    ("{a};{b}:negatives=mined,mined={missing}", ["negatives.source=random", "negatives.per_query=1"],
     "negatives.mined.file="),
])
def test_plan_refuses_a_bad_entry_by_number(tmp_path, entries, overrides, reason):
  a, b = write_tiny_beir(tmp_path / "a"), write_tiny_beir(tmp_path / "b", num_docs=24, seed=1)
  text = entries.format(a=a, b=b, missing=tmp_path / "missing")
  with pytest.raises(ValueError) as e:
    mixture.plan(_config(*overrides, f"data.mixture={text}"), sources.SAMPLERS, sources.check)
  message = str(e.value)
  assert "\n" not in message and message.startswith("data.mixture entry 2 (") and reason in message, message


@pytest.mark.parametrize("overrides,reason", [
    (["data.mixture_sampling=mixed"], "data.mixture_sampling must be one of proportional, round_robin"),
    (["data.kind=pretrain"], "data.kind='pretrain'"),
    (["distill.teacher=mined"], "distill.teacher"),
    (["data.dataset=elsewhere"], "data.dataset=elsewhere would not be read"),
])
def test_plan_refuses_what_a_mixture_cannot_run(tmp_path, overrides, reason):
  a = write_tiny_beir(tmp_path / "a")
  with pytest.raises(mixture.MixtureError, match=reason):
    mixture.plan(_config(f"data.mixture={a};builtin", *overrides), sources.SAMPLERS, sources.check)


def test_a_bad_entry_stops_the_trainer_before_anything_is_read(tmp_path):
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  a = write_tiny_beir(tmp_path / "a")
  config = _config(f"data.mixture={a}:weight=1;{a}:weight=2,name=again,negatives=ance")
  with pytest.raises(mixture.MixtureError, match="entry 2 .*negatives='ance'"):
    trainer.train_and_evaluate(config, tmp_path / "w")
  assert not (tmp_path / "w").exists()


# ------------------------------------------------------------------------------------------------ the batches


def _data(prefix: str, n: int) -> pairs.RetrievalData:
  """In memory: query PREFIXq{i} -> document PREFIXd{i}, n more documents unjudged; ids carry the dataset."""
  words = [f"{prefix.lower()}{w}" for w in ("ton", "lith", "mere", "vox", "zen", "kappa", "sigma")]
  corpus = {f"{prefix}d{i}": formats.Doc(f"{prefix}d{i}", "", f"{words[i % 7]} {words[(i * 3) % 7]} {i}")
            for i in range(2 * n)}
  queries = {f"{prefix}q{i}": f"{words[i % 7]} {i}" for i in range(n)}
  qrels = {f"{prefix}q{i}": {f"{prefix}d{i}": 1} for i in range(n)}
  return pairs.RetrievalData(corpus, queries, qrels, None, prefix)


def _mixture(tokenizer, sampling="proportional", per_query=2, seed=0):
  """A: random negatives, in-batch on; B: none (padded to A's shape), in-batch on; C: random, in-batch off."""
  entries = [mixture.Entry(p, p, weight=w, name=p) for p, w in (("A", 2.0), ("B", 1.0), ("C", 1.0))]
  entries[1].padding_per_query = per_query

  def make(i, data):
    return pairs.Batches(data, tokenizer, batch_size=4, query_max_length=8, doc_max_length=12,
                         negative_source=None if i == 1 else sampled.RandomNegatives(data.corpus, data.train_qrels),
                         negatives_per_query=per_query, in_batch=i != 2, seed=seed + i,
                         padding_per_query=per_query if i == 1 else 0)

  data = [_data("A", 12), _data("B", 9), _data("C", 10)]
  per_dataset = [make(i, d) for i, d in enumerate(data)]
  return mixture.Mixture(entries, per_dataset, sampling, seed), lambda i: make(i, data[i])


class _IdsOnly:
  pad_token_id = 0


def test_each_batch_is_one_datasets_and_each_keeps_its_in_batch_choice():
  mix, _ = _mixture(_IdsOnly())
  B, n = 4, 2
  expected = _independent_draw([2.0, 1.0, 1.0], 0, 60)
  for step in range(60):
    i, j = mix.position(step)
    assert i == expected[step]
    qids, doc_ids, valid = mix.global_layout(step)
    prefix = "ABC"[i]
    assert valid.shape == (B, B * (1 + n))  # one shape for every dataset
    assert all(q.startswith(prefix) for q in qids) and all(d.startswith(prefix) for d in doc_ids)
    own = lambda b: {b} | set(range(B + b * n, B + (b + 1) * n))
    for b in range(B):
      assert valid[b, b]
      if prefix == "A":  # in-batch on: the other rows' positives and negatives are candidates too
        assert valid[b, [c for c in range(B * (1 + n)) if c not in own(b)]].any()
      if prefix == "B":  # no negatives: the padding columns are never candidates; the other rows' positives are
        assert not valid[:, B:].any()
        assert valid[b, :B].tolist() == [c == b or doc_ids[c] != doc_ids[b] for c in range(B)]  # (an epoch's end
        # can hold a pair twice)
      if prefix == "C":  # in-batch off: only the row's positive and its own sampled negatives
        assert [c for c in range(B * (1 + n)) if valid[b, c]] == sorted(own(b))
  assert sorted(set(expected.tolist())) == [0, 1, 2]


def test_local_batches_are_the_drawn_datasets_own_and_share_one_shape(minilm_tokenizer):
  mix, fresh = _mixture(minilm_tokenizer)
  shapes = set()
  for step in range(24):
    i, j = mix.position(step)
    got, want = mix.local(step), fresh(i).local(j)  # a fresh Batches: the mixture adds nothing but the choice
    assert sorted(got) == sorted(want)
    for key in got:
      np.testing.assert_array_equal(got[key], want[key])
    shapes.add(tuple((k, v.shape) for k, v in sorted(got.items())))
  assert len(shapes) == 1, shapes
  # Padding columns hold real tokens (the positives repeated), so every pooling reads a real document.
  b_step = next(s for s in range(24) if mix.position(s)[0] == 1)
  batch = mix.local(b_step)
  np.testing.assert_array_equal(batch["doc_ids"][4:], np.repeat(batch["doc_ids"][:4], 2, axis=0))
  scalars = mix.log_scalars(24)
  counts = np.bincount(_independent_draw([2.0, 1.0, 1.0], 0, 24), minlength=3)
  assert {k: scalars[k] for k in ("mixture/A", "mixture/B", "mixture/C")} == \
      {f"mixture/{p}": c / 24 for p, c in zip("ABC", counts)}


def test_one_dataset_is_the_plain_batches():
  data = _data("A", 12)
  make = lambda: pairs.Batches(data, _IdsOnly(), batch_size=4, query_max_length=8, doc_max_length=12,
                               negative_source=sampled.RandomNegatives(data.corpus, data.train_qrels),
                               negatives_per_query=1, seed=5)
  alone = mixture.Mixture([mixture.Entry("A", "A", name="A")], [make()], "proportional", 5)
  plain = make()
  for step in range(30):
    got, want = alone.global_layout(step), plain.global_layout(step)
    assert got[:2] == want[:2] and np.array_equal(got[2], want[2])


def test_datasets_of_another_shape_are_refused():
  a, b = _data("A", 8), _data("B", 8)
  make = lambda d, per_query, padding: pairs.Batches(
      d, _IdsOnly(), batch_size=4, query_max_length=8, doc_max_length=12, negatives_per_query=per_query,
      negative_source=sampled.RandomNegatives(d.corpus, d.train_qrels) if per_query else None,
      padding_per_query=padding)
  entries = [mixture.Entry("A", "A", name="A"), mixture.Entry("B", "B", name="B")]
  with pytest.raises(ValueError, match="B's batches .* differ from A's"):
    mixture.Mixture(entries, [make(a, 2, 0), make(b, 0, 0)], "proportional", 0)
  mixture.Mixture(entries, [make(a, 2, 0), make(b, 0, 2)], "proportional", 0)  # padded: the same shape


def test_a_datasets_prompt_is_put_before_its_queries_only(tmp_path, minilm_tokenizer):
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  a, b = write_tiny_beir(tmp_path / "a"), write_tiny_beir(tmp_path / "b", num_docs=24, seed=1)
  config = _config(f"data.mixture={a};{b}:prompt='query: '")
  first, second = mixture.plan(config, sources.SAMPLERS, sources.check)
  model_prompts = {"query": "", "doc": "passage: "}
  made = [trainer.pair_batches(e.config, pairs.load(e.config.data, tmp_path), sources.Negatives("tokens"),
                               minilm_tokenizer, model_prompts, e) for e in (first, second)]
  assert [text_lib.prompt_of(m.query_tokenizer) for m in made] == ["", "query: "]
  assert [text_lib.prompt_of(m.doc_tokenizer) for m in made] == ["passage: ", "passage: "]


# ------------------------------------------------------------------------------------------------ the trainer


def _records(workdir) -> list[dict]:
  return [json.loads(l) for l in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def test_a_run_resumed_mid_mixture_is_bitwise_the_uninterrupted_one(tmp_path, capsys):
  """Three datasets (random negatives; none, padded; random without in-batch negatives), 10 steps, checkpoints
  at 5 and 10: resumed from step 5 (as if killed between 5 and 10), the weights equal the straight run's, bitwise,
  and the logged shares are the schedule's."""
  from jdr.runtime import checkpoint  # pylint: disable=g-import-not-at-top
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  a = write_tiny_beir(tmp_path / "a")
  b = write_tiny_beir(tmp_path / "b", num_docs=24, seed=1)
  c = write_tiny_beir(tmp_path / "c", num_docs=28, seed=2)
  steps = 10
  config = _config("model.init_from=", "model.fresh=tiny", "model.dropout=0.1", "optimizer.learning_rate=1e-3",
                   "optimizer.warmup_steps=2", "batch_size=4", "log_every=1", "data.query_max_length=12",
                   "data.doc_max_length=16", "data.eval_split=",
                   "negatives.source=random", "negatives.per_query=1", f"num_train_steps={steps}",
                   "checkpoint_every=5", "keep_checkpoints=5", "seed=2",
                   f"data.mixture={a}:weight=2;{b}:negatives=none,prompt='q: ';{c}:in_batch=0")
  straight = trainer.train_and_evaluate(config, tmp_path / "straight")["state"]
  printed = capsys.readouterr().err
  assert "data.mixture: 3 datasets, proportional, 10 steps of 4" in printed
  assert "a: weight 2, planned 50.0%" in printed and "b: weight 1, planned 25.0%" in printed

  drawn = _independent_draw([2.0, 1.0, 1.0], 2, steps)
  assert len(set(drawn[:5].tolist())) > 1 and len(set(drawn[5:].tolist())) > 1  # resumed mid-mixture
  logged = {r["step"]: r for r in _records(tmp_path / "straight") if "train/loss" in r}
  for done in range(1, steps + 1):
    counts = np.bincount(drawn[:done], minlength=3)
    assert [logged[done][f"train/mixture/{n}"] for n in "abc"] == [x / done for x in counts.tolist()]

  shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / str(steps))  # as if killed between steps 5 and 10
  resumed = trainer.train_and_evaluate(config, tmp_path / "resumed")["state"]
  assert int(resumed.step) == steps
  want = jax.tree.leaves(jax.device_get(straight.params))
  got = jax.tree.leaves(checkpoint.latest_params(tmp_path / "resumed"))
  assert len(want) == len(got)
  for x, y in zip(want, got):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # bitwise
