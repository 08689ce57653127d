import bz2
import collections
import json
import textwrap

import numpy as np
import pytest

from jdr.data import articles as A
from jdr.data import pretrain as P
from jdr.data.shared import shared_data_dir, shared_dataset


def tiny_articles():
  return [
      A.Article("alpha", "Alpha", ["Alpha is the first letter. It comes before every other letter."],
                [["Alpha was used by the Greeks. Later the Romans used it too. Beta follows it in order.",
                  "One sentence only about the letter."]], ["beta", "gamma"]),
      A.Article("beta", "Beta", ["Beta is the second letter. It follows Alpha closely."],
                [["Beta sounds like the English b. It is written with a long stem.",
                  "Gamma comes after beta in the alphabet. Everyone learns that early."]], ["gamma", "alpha"]),
      A.Article("gamma", "Gamma (letter)", ["Gamma is the third letter."],
                [["Gamma rays are named after it. They carry a lot of energy."]], ["alpha"]),
      A.Article("delta", "Delta", [], [["Delta is a river mouth. It is triangular in shape."]], ["alpha"]),
  ]


def by_id(articles):
  return {a.id: a for a in articles}


def test_split_sentences():
  assert A.split_sentences("Dr. Smith went to Washington. He liked it! Was it 3.5 km away?") == [
      "Dr. Smith went to Washington.", "He liked it!", "Was it 3.5 km away?"]
  assert A.split_sentences("  ... -- !  ") == []
  assert A.split_sentences("") == []


@pytest.mark.parametrize("keep", [0.0, 1.0])
def test_ict_query_is_a_sentence_of_its_passage(keep):
  arts = tiny_articles()
  pairs = P.PretrainPairs(arts, "ict", seed=3, keep_sentence_prob=keep)
  seen = set()
  for index in range(300):
    d = pairs.draw(index)
    a = by_id(arts)[d.pair.article_id]
    sentences = a.sentences(*d.doc_place)
    assert len(sentences) >= 2 and d.pair.query == sentences[d.query_place[2]]
    assert d.pair.task == "ict" and d.pair.doc_title == a.title and d.query_article_id == a.id
    others = [s for s in sentences if s != d.pair.query]
    if keep == 0.0:
      assert d.pair.query not in d.pair.doc_text and d.pair.doc_text == " ".join(others)
    else:
      assert d.pair.query in d.pair.doc_text and d.pair.doc_text == " ".join(sentences)
    seen.add(d.doc_place + (a.id,))
  # Every passage with >= 2 sentences is used; the one-sentence passage is skipped and counted.
  assert len(seen) == 7 and pairs.stats["ict_short_passage"] > 0


def test_ict_keeps_the_sentence_at_the_given_rate():
  pairs = P.PretrainPairs(tiny_articles(), "ict", seed=0, keep_sentence_prob=0.3)
  kept = np.mean([pairs.draw(i).kept_sentence for i in range(2000)])
  assert 0.26 < kept < 0.34


def test_bfs_query_comes_from_the_lead_of_the_documents_article():
  arts = tiny_articles()
  pairs = P.PretrainPairs(arts, "bfs", seed=1)
  docs = set()
  for index in range(300):
    d = pairs.draw(index)
    a = by_id(arts)[d.pair.article_id]
    assert d.pair.query in [s for _, _, s in a.lead_sentences()] and d.query_place[0] == A.LEAD
    assert d.doc_place[0] != A.LEAD and d.pair.doc_text == a.paragraph(*d.doc_place)
    assert d.pair.doc_title == a.title and d.query_article_id == a.id
    docs.add((a.id, d.doc_place))
  assert "delta" not in {a for a, _ in docs} and len(docs) == 5  # delta has no lead
  assert pairs.stats["bfs_no_lead"] == 1


def test_wlp_follows_a_real_link():
  arts = tiny_articles()
  index = by_id(arts)
  pairs = P.PretrainPairs(arts, "wlp", seed=2)
  links = set()
  for i in range(400):
    d = pairs.draw(i)
    a, b = index[d.pair.article_id], index[d.query_article_id]
    assert b.id in a.links and a.id != b.id
    assert d.pair.query in [s for _, _, s in b.lead_sentences()]
    assert d.pair.doc_text == a.paragraph(*d.doc_place) and d.pair.doc_title == a.title
    if d.mention:  # the title, or the title without "(letter)", is in the document
      assert b.title.split(" (")[0].lower() in d.pair.doc_text.lower()
    links.add((a.id, b.id))
  assert links == {(a.id, t) for a in arts for t in a.links}
  # alpha -> gamma: "Gamma" is not in alpha's text, so a random passage of alpha stands in, counted.
  assert pairs.mention_passages(0, 2) == [] and pairs.stats["wlp_no_mention"] > 0
  assert pairs.mention_passages(1, 2) == [(0, 1)]  # "Gamma (letter)" found as "gamma"
  strict = P.PretrainPairs(arts, "wlp", seed=2, wlp_require_mention=True)
  assert all(strict.draw(i).mention for i in range(100))


def test_mixed_draws_all_three_tasks_uniformly():
  pairs = P.PretrainPairs(tiny_articles(), seed=0)
  counts = collections.Counter(pairs.pair(i).task for i in range(900))
  assert set(counts) == {"ict", "bfs", "wlp"} and all(250 < n < 350 for n in counts.values())
  assert len(pairs) == sum(pairs.units.values())


def test_pairs_are_a_pure_function_of_seed_and_index():
  a, b = P.PretrainPairs(tiny_articles(), seed=7), P.PretrainPairs(tiny_articles(), seed=7)
  forward = [a.pair(i) for i in range(200)]
  assert [b.pair(i) for i in reversed(range(200))][::-1] == forward  # order of access does not matter
  assert [a.pair(i) for i in range(200)] == forward
  other = P.PretrainPairs(tiny_articles(), seed=8)
  assert [other.pair(i) for i in range(200)] != forward


def test_pretrain_pairs_refuses_a_task_without_candidates():
  no_links = [A.Article("x", "X", ["X is a thing. It is here."], [["Body text here. More text."]], [])]
  with pytest.raises(ValueError, match="wlp"):
    P.PretrainPairs(no_links)
  assert P.PretrainPairs(no_links, tasks=("ict", "bfs")).pair(0).task in ("ict", "bfs")


def test_mask_tokens_80_10_10_and_specials_never_masked():
  rng = np.random.default_rng(0)
  vocab, mask_id, specials = 1000, 3, (0, 1, 2)
  ids = rng.integers(4, vocab, size=(400, 500)).astype(np.int32)
  ids[:, 0], ids[:, -1], ids[:, -40:-1] = 1, 2, 0  # CLS, SEP, padding
  inputs, labels = P.mask_tokens(ids, np.random.default_rng(1), vocab, mask_id, specials)
  special = np.isin(ids, specials)
  chosen = labels != -100
  assert inputs.shape == ids.shape and inputs.dtype == ids.dtype
  assert not chosen[special].any() and (inputs[special] == ids[special]).all()
  assert (labels[chosen] == ids[chosen]).all() and (inputs[~chosen] == ids[~chosen]).all()
  assert abs(chosen.sum() / (~special).sum() - 0.15) < 0.005
  masked = (inputs == mask_id)[chosen].mean()
  same = (inputs == ids)[chosen].mean()
  replaced = ((inputs != ids) & (inputs != mask_id))[chosen].mean()
  assert abs(masked - 0.8) < 0.01 and abs(same - 0.1) < 0.01 and abs(replaced - 0.1) < 0.01
  assert not np.isin(inputs[chosen & (inputs != mask_id)], specials + (mask_id,)).any()
  again, _ = P.mask_tokens(ids, np.random.default_rng(1), vocab, mask_id, specials)
  assert (again == inputs).all()


def write_tiny_wikispeedia(directory):
  records = [
      {"id": "Alpha", "title": "Alpha", "lead": ["Alpha is first. It leads."],
       "sections": [{"heading": "History", "paragraphs": ["Alpha met Beta. They talked.", "   ", "* * *"]}],
       "links_out": ["Beta", "Nowhere"]},
      {"id": "Beta", "title": "Beta", "lead": [],
       "sections": [{"heading": "Body", "paragraphs": ["Beta has no lead. Still it has text."]}],
       "links_out": ["Alpha", "Beta"]},
  ]
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "articles_subset.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  # Rows: a mention after the dropped empty paragraph (to be moved), one naming no passage, one no link.
  (directory / "link_passages_subset.tsv").write_text(
      "source_id\ttarget_id\tsection_index\tparagraph_index\n"
      "Alpha\tBeta\t0\t0\nAlpha\tBeta\t0\t9\nBeta\tGamma\t0\t0\nAlpha\tBeta\t0\t2\n")
  return directory


def test_reader_counts_every_kind_of_bad_input(tmp_path):
  arts, report = A.read_wikispeedia(write_tiny_wikispeedia(tmp_path / "ws"))
  print(report)
  alpha, beta = arts
  assert report[A.NO_LEAD] == 1 and report.examples[A.NO_LEAD] == ["Beta"]
  assert report[A.MISSING_LINK] == 1 and report.examples[A.MISSING_LINK] == ["Alpha->Nowhere"]
  assert report[A.SELF_LINK] == 1
  assert report[A.EMPTY_PASSAGE] == 1 and alpha.sections == [["Alpha met Beta. They talked.", "* * *"]]
  assert report[A.NO_SENTENCE] == 1 and report.examples[A.NO_SENTENCE] == ["Alpha[0,1]"]
  # Row 0 9: no such passage; Beta -> Gamma: no such link; the row after the empty paragraph moved from 2 to 1.
  assert report[A.BAD_MENTION] == 2 and alpha.mentions == {"Beta": [(0, 0), (0, 1)]}
  assert alpha.links == ["Beta"] and beta.links == ["Alpha"]
  assert report.totals["articles"] == 2 and report.totals["paragraphs"] == 4


def write_tiny_dump(path, compress=False):
  xml = textwrap.dedent("""\
      <mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10">
        <siteinfo><namespaces><namespace key="6" case="first-letter">File</namespace>
          <namespace key="14" case="first-letter">Category</namespace></namespaces></siteinfo>
        <page><title>Paris</title><ns>0</ns><id>1</id><revision><text xml:space="preserve">{{Infobox city|name=Paris}}
      '''Paris''' is the capital of [[France]].&lt;ref&gt;{{cite web|url=x}}&lt;/ref&gt; It lies on the [[Seine river|Seine]].

      [[File:Eiffel.jpg|thumb|The [[Eiffel Tower]]]]
      It is a very old city. It was founded long ago.&lt;!-- hidden --&gt;

      == History ==
      The [[Romans]] founded a town here. It grew slowly.

      === Middle Ages ===
      Kings of [[france]] lived here. They built castles.

      == See also ==
      * [[Lyon]]

      [[Category:Capitals]]
      </text></revision></page>
        <page><title>France</title><ns>0</ns><id>2</id><revision><text xml:space="preserve">'''France''' is a country. Its capital is [[Paris]].

      == Geography ==
      Rivers include the [[Seine]]. The [[Seine]] flows through [[Paris#Center|the capital]].
      </text></revision></page>
        <page><title>Seine river</title><ns>0</ns><id>3</id><redirect title="Seine" />
          <revision><text xml:space="preserve">#REDIRECT [[Seine]]</text></revision></page>
        <page><title>Seine</title><ns>0</ns><id>4</id><revision><text xml:space="preserve">The '''Seine''' is a river. It flows through [[Paris]].</text></revision></page>
        <page><title>Talk:Paris</title><ns>1</ns><id>5</id><revision><text>Talk.</text></revision></page>
      </mediawiki>
      """)
  data = xml.encode()
  path.write_bytes(bz2.compress(data) if compress else data)
  return path


@pytest.mark.parametrize("compress", [False, True])
def test_wikipedia_xml_reader(tmp_path, compress):
  arts, report = A.read_wikipedia_xml(write_tiny_dump(tmp_path / "dump.xml.bz2", compress))
  print(report)
  index = by_id(arts)
  assert sorted(index) == ["France", "Paris", "Seine"]
  paris = index["Paris"]
  assert paris.lead == ["Paris is the capital of France. It lies on the Seine.",
                        "It is a very old city. It was founded long ago."]
  # "=== Middle Ages ===" stays in History; "See also" gives a link, no passage.
  assert paris.sections == [["The Romans founded a town here. It grew slowly.",
                             "Kings of france lived here. They built castles."]]
  assert paris.links == ["France", "Seine"]  # via the redirect; [[france]] normalized; no File:/Category:
  assert paris.mentions == {"France": [(A.LEAD, 0), (0, 1)], "Seine": [(A.LEAD, 0)]}
  # Romans and Lyon are missing; Eiffel Tower went with the file's caption.
  assert sorted(report.examples[A.MISSING_LINK]) == ["Paris->Lyon", "Paris->Romans"]
  assert report.totals["redirects"] == 1 and report.totals["non_article_pages"] == 1
  assert report.totals["links_via_redirect"] == 1 and report[A.BAD_MENTION] == 0
  assert index["France"].links == ["Paris", "Seine"] and index["France"].mentions["Paris"] == [(A.LEAD, 0), (0, 0)]
  pairs = P.PretrainPairs(arts, seed=0)
  assert {pairs.pair(i).task for i in range(60)} == {"ict", "bfs", "wlp"}


def test_wikipedia_xml_reader_refuses_other_files(tmp_path):
  text = tmp_path / "notes.txt"
  text.write_text("just some notes, not XML\n")
  with pytest.raises(ValueError, match=r"notes\.txt: not a MediaWiki XML dump: .*syntax error"):
    A.read_wikipedia_xml(text)
  html = tmp_path / "page.html"
  html.write_text("<html><body>hi</body></html>")
  with pytest.raises(ValueError, match=r"page\.html: not a MediaWiki XML dump: the root element is <html>"):
    A.read_wikipedia_xml(html)
  empty = tmp_path / "empty.xml"
  empty.write_text("")
  with pytest.raises(ValueError, match="empty.xml: not a MediaWiki XML dump"):
    A.read_wikipedia_xml(empty)


FAKE_STDLIB = {
    "heap.py": '''
        """Heap queue algorithm.

        Heaps are binary trees. See the sorting module and sorting.sort_list for more.

        Another paragraph of the module doc.
        """
        def push(heap, item):
            """Push item onto heap. Uses shelf.Store when asked.

            >>> push([], 1)
            []

            Keeps the invariant.
            """
        def _hidden():
            """Never seen."""
        class Queue:
            """A queue on a heap. It is fast."""
            def pop(self):
                """Pop the smallest item. Raises IndexError."""
        ''',
    "sorting.py": '''
        """Sorting helpers for lists. The `heap` module is faster for streams."""
        def sort_list(xs):
            """Sort a list in place. Returns None."""
        ''',
    "shelf/__init__.py": '''
        def Store():
            """A store with no module docstring. It uses this module."""
        ''',
    "_private.py": '"""Private."""\n',
    "empty.py": "x = 1\n",
}


def test_builtin_articles_on_a_fake_stdlib(tmp_path):
  for name, source in FAKE_STDLIB.items():
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(textwrap.dedent(source))
  arts, report = A.builtin_articles(tmp_path)
  print(report)
  index = by_id(arts)
  assert list(index) == ["heap", "shelf", "sorting"]
  heap = index["heap"]
  assert heap.lead == ["Heap queue algorithm.", "Heaps are binary trees. See the sorting module and "
                       "sorting.sort_list for more."]
  assert heap.sections == [["Another paragraph of the module doc.",
                            "Push item onto heap. Uses shelf.Store when asked. Keeps the invariant.",
                            "A queue on a heap. It is fast.", "Pop the smallest item. Raises IndexError."]]
  assert heap.links == ["shelf", "sorting"] and heap.mentions == {"sorting": [(A.LEAD, 1)], "shelf": [(0, 1)]}
  assert index["sorting"].links == ["heap"] and index["shelf"].links == []
  assert report[A.NO_LEAD] == 1 and report.examples[A.NO_LEAD] == ["shelf"]
  assert report[A.NO_TEXT] == 1 and report.examples[A.NO_TEXT] == ["empty"]
  again, _ = A.builtin_articles(tmp_path)
  assert again == arts


@pytest.mark.slow
def test_wikispeedia_smoke():
  directory = shared_dataset("wikispeedia")
  if directory is None:
    pytest.skip(f"real data absent: {shared_data_dir() / 'wikispeedia'} (set JDR_SHARED_DATA)")
  # Sentences are split lazily here: checking all 48k paragraphs takes about a minute.
  arts, report = A.read_wikispeedia(directory, check_sentences=False)
  print(report)
  assert report.totals["articles"] == 1629 and report.totals["paragraphs"] == 48426
  assert report[A.NO_LEAD] == 1 and report.totals["links"] == 47940 - report[A.SELF_LINK]
  pairs = P.PretrainPairs(arts, seed=0)
  index = by_id(arts)
  tasks = collections.Counter()
  for i in range(300):
    d = pairs.draw(i)
    tasks[d.pair.task] += 1
    if d.pair.task == "wlp":
      assert d.query_article_id in index[d.pair.article_id].links
    assert d.pair.query and d.pair.doc_text
  print("units", pairs.units, "tasks", dict(tasks), "stats", dict(pairs.stats))
  assert set(tasks) == {"ict", "bfs", "wlp"}
