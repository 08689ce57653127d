"""Linked articles (a lead, sections of paragraphs, links to other articles): the input of ICT/BFS/WLP pretraining.

Three readers, each returning `(articles, report)`:

  read_wikispeedia(directory)   the shared Wikispeedia subset (`articles_subset.jsonl`, `link_passages_subset.tsv`)
  builtin_articles()            the standard library as articles: one per module, parsed with `ast`, never imported
  read_wikipedia_xml(path)      a local MediaWiki XML dump (plain or .bz2), parsed with mwparserfromhell

A reader never drops a problem silently: the report counts each kind (articles without a lead, links to missing
articles, empty passages, paragraphs in which the sentence splitter finds no sentence, ...) with a few example
ids. Empty paragraphs and unresolvable links are removed (and counted); articles without a lead and paragraphs
without a sentence are kept (and counted): they still serve the tasks that do not need them.

A passage is one paragraph, addressed as (section, paragraph) with section `LEAD` (-1) for the lead, as in
`link_passages_subset.tsv`. `Article.mentions` maps a linked article's id to the passages that hold the link
(or, for Wikispeedia, mention its title): WLP prefers those passages as documents.

Sentences come from `split_sentences` (pysbd, rule-based, no downloads), cached per paragraph on the article, so
splitting happens once whether the reader checks sentences or the pair generator asks first.
"""

import ast
import bz2
import collections
import dataclasses
import functools
import gzip
import inspect
import json
import pathlib
import re
import sysconfig
import xml.etree.ElementTree as ET

from jdr.data import builtin

LEAD = -1

# Problem kinds a report counts.
NO_LEAD = "no_lead"  # article kept: it still gives ICT passages and WLP documents
NO_TEXT = "no_text"  # article with neither lead nor passages: dropped
MISSING_LINK = "missing_link_target"  # link to an id that is not among the articles: dropped
SELF_LINK = "self_link"  # dropped (a WLP pair from it would be a BFS pair)
DUPLICATE_LINK = "duplicate_link"  # dropped
DUPLICATE_ID = "duplicate_id"  # later article with an id already read: dropped
EMPTY_PASSAGE = "empty_passage"  # whitespace-only paragraph: dropped
NO_SENTENCE = "no_sentence"  # paragraph where the splitter finds no sentence: kept
BAD_MENTION = "bad_mention"  # a mention row naming an unknown article, passage or link: dropped


class Report:
  """What a reader met: `totals` (things read) and `problems` (counts per kind) with up to 5 example ids each."""

  def __init__(self, source: str):
    self.source = source
    self.totals = collections.Counter()
    self.problems = collections.Counter()
    self.examples: dict[str, list[str]] = {}

  def problem(self, kind: str, example: str, n: int = 1) -> None:
    self.problems[kind] += n
    examples = self.examples.setdefault(kind, [])
    if len(examples) < 5:
      examples.append(example)

  def __getitem__(self, kind: str) -> int:
    return self.problems[kind]

  def __str__(self) -> str:
    lines = [f"{self.source}: " + ", ".join(f"{k} {v:,}" for k, v in self.totals.items())]
    for kind, n in sorted(self.problems.items()):
      lines.append(f"  {kind}: {n:,} (e.g. {', '.join(self.examples.get(kind, []))})")
    return "\n".join(lines)


@dataclasses.dataclass
class Article:
  id: str
  title: str
  lead: list[str]  # paragraphs
  sections: list[list[str]]  # paragraphs per section
  links: list[str]  # ids of other articles in the same collection
  mentions: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)  # link id -> passages
  _sentences: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

  def paragraph(self, section: int, index: int) -> str:
    return self.lead[index] if section == LEAD else self.sections[section][index]

  def passages(self, body_only: bool = False) -> list[tuple[int, int]]:
    """(section, paragraph) of every paragraph, lead first unless body_only."""
    lead = [] if body_only else [(LEAD, i) for i in range(len(self.lead))]
    return lead + [(s, i) for s, section in enumerate(self.sections) for i in range(len(section))]

  def sentences(self, section: int, index: int) -> list[str]:
    key = (section, index)
    if key not in self._sentences:
      self._sentences[key] = split_sentences(self.paragraph(section, index))
    return self._sentences[key]

  def lead_sentences(self) -> list[tuple[int, int, str]]:
    """(lead paragraph, sentence index, sentence) over the whole lead."""
    return [(p, i, s) for p in range(len(self.lead)) for i, s in enumerate(self.sentences(LEAD, p))]


# ---------------------------------------------------------------------------------------------------------------
# Sentences

@functools.cache
def _segmenter():
  import pysbd  # pylint: disable=g-import-not-at-top
  return pysbd.Segmenter(language="en", clean=False)


_WORD = re.compile(r"\w")


def split_sentences(text: str) -> list[str]:
  """The sentences of one paragraph, stripped; pieces without a letter or digit ("...", "--") are not sentences."""
  if not _WORD.search(text):
    return []
  return [s for s in (piece.strip() for piece in _segmenter().segment(text)) if _WORD.search(s)]


# ---------------------------------------------------------------------------------------------------------------
# Shared checks: every reader builds raw articles and lets this count and repair the same problems.

def _finish(raw: list[Article], report: Report, check_sentences: bool) -> list[Article]:
  articles, ids = [], set()
  for a in raw:
    if a.id in ids:
      report.problem(DUPLICATE_ID, a.id)
      continue
    ids.add(a.id)
    articles.append(a)
  kept = []
  for a in articles:
    _drop_empty_paragraphs(a, report)
    if not a.lead and not a.sections:
      report.problem(NO_TEXT, a.id)
      continue
    kept.append(a)
  ids = {a.id for a in kept}
  for a in kept:
    links, seen, named = [], set(), set(a.links)
    for target in a.links:
      if target == a.id:
        report.problem(SELF_LINK, a.id)
      elif target in seen:
        report.problem(DUPLICATE_LINK, f"{a.id}->{target}")
      elif target not in ids:
        report.problem(MISSING_LINK, f"{a.id}->{target}")
      else:
        seen.add(target)
        links.append(target)
    a.links = links
    for target in [t for t in a.mentions if t not in seen]:
      if target not in named:  # mentions of a dropped link go with it
        report.problem(BAD_MENTION, f"{a.id}->{target}: no such link", len(a.mentions[target]))
      del a.mentions[target]
    if not a.lead:
      report.problem(NO_LEAD, a.id)
    if check_sentences:
      for s, p in a.passages():
        if not a.sentences(s, p):
          report.problem(NO_SENTENCE, f"{a.id}[{s},{p}]")
  report.totals["articles"] = len(kept)
  report.totals["paragraphs"] = sum(len(a.lead) + sum(map(len, a.sections)) for a in kept)
  report.totals["links"] = sum(len(a.links) for a in kept)
  return kept


def _drop_empty_paragraphs(a: Article, report: Report) -> None:
  """Removes whitespace-only paragraphs and sections left empty, moving mentions to the new positions."""
  where = {}  # old (section, paragraph) -> new

  def keep(section_old, section_new, paragraphs):
    out = []
    for i, text in enumerate(paragraphs):
      if text.strip():
        where[(section_old, i)] = (section_new, len(out))
        out.append(text)
      else:
        report.problem(EMPTY_PASSAGE, f"{a.id}[{section_old},{i}]")
    return out

  a.lead = keep(LEAD, LEAD, a.lead)
  sections = []
  for s, paragraphs in enumerate(a.sections):
    kept = keep(s, len(sections), paragraphs)
    if kept:
      sections.append(kept)
  a.sections = sections
  for target, places in list(a.mentions.items()):
    moved = sorted({where[p] for p in places if p in where})
    if len(moved) < len(places):
      report.problem(BAD_MENTION, f"{a.id}->{target}: no such passage", len(places) - len(moved))
    a.mentions[target] = moved


def _add_mention(mentions: dict, target: str, place: tuple[int, int]) -> None:
  places = mentions.setdefault(target, [])
  if place not in places:
    places.append(place)


# ---------------------------------------------------------------------------------------------------------------
# Wikispeedia

def read_wikispeedia(directory, check_sentences: bool = True) -> tuple[list[Article], Report]:
  """The shared Wikispeedia subset: links restricted to the subset (the rest count as missing targets).

  `link_passages_subset.tsv`, when present, gives the mentions. Splitting all 48k paragraphs into sentences
  takes about a minute on one core; `check_sentences=False` leaves it to the pair generator, lazily.
  """
  directory = pathlib.Path(directory)
  path = directory / "articles_subset.jsonl"
  report = Report(str(directory))
  raw = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        d = json.loads(line)
        raw.append(Article(d["id"], d["title"], list(d["lead"]),
                           [list(s["paragraphs"]) for s in d["sections"]], list(d["links_out"])))
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}:{number}: not a Wikispeedia article record: {e!r}") from e
  passages = directory / "link_passages_subset.tsv"
  if passages.exists():
    by_id = {a.id: a for a in raw}
    with open(passages, encoding="utf-8") as f:
      header = f.readline().split()
      if header != ["source_id", "target_id", "section_index", "paragraph_index"]:
        raise ValueError(f"{passages}:1: expected the header source_id target_id section_index paragraph_index")
      for number, line in enumerate(f, 2):
        fields = line.rstrip("\n").split("\t")
        if len(fields) != 4:
          raise ValueError(f"{passages}:{number}: expected 4 tab-separated fields, got {len(fields)}")
        source, target, section, paragraph = fields[0], fields[1], int(fields[2]), int(fields[3])
        a = by_id.get(source)
        if a is None or not (-1 <= section < len(a.sections)) or not (
            0 <= paragraph < (len(a.lead) if section == LEAD else len(a.sections[section]))):
          report.problem(BAD_MENTION, f"{passages.name}:{number}")
          continue
        _add_mention(a.mentions, target, (section, paragraph))
  return _finish(raw, report, check_sentences), report


# ---------------------------------------------------------------------------------------------------------------
# The standard library

_DOCTEST = re.compile(r"^\s*(>>>|\.\.\. )")


def _docstring_paragraphs(doc: str) -> list[str]:
  """Blank-line separated paragraphs, whitespace collapsed, doctest examples (and their output) dropped."""
  paragraphs, in_example = [], False
  for block in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
    lines = []
    for line in block.splitlines():
      in_example = bool(_DOCTEST.match(line)) or (in_example and line.strip() != "")
      if not in_example:
        lines.append(line.strip())
    in_example = False
    text = " ".join(" ".join(lines).split())
    if text:
      paragraphs.append(text)
  return paragraphs


_DOTTED = re.compile(r"\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
_NAMED = re.compile(r":mod:`~?([\w.]+)`|`([\w.]+)`|\bmodules? ([\w.]+)|\b([\w.]+) (?:module|package)\b")


def _module_mentions(text: str, modules: set[str]) -> list[str]:
  """Stdlib module names the text refers to: `x.y` references (longest module prefix), ":mod:`x`", "`x`",
  "module x" or "x module". A bare word is not enough: string, time, copy and this are modules and words."""
  found = []
  for m in _DOTTED.finditer(text):
    parts = m.group(0).split(".")
    for k in range(len(parts), 0, -1):
      name = ".".join(parts[:k])
      if name in modules:
        found.append(name)
        break
  for m in _NAMED.finditer(text):
    name = next(g for g in m.groups() if g).rstrip(".")
    if name in modules and name != "this":  # "this module" is no reference to the Zen of Python
      found.append(name)
  return found


def builtin_articles(stdlib=None, check_sentences: bool = True) -> tuple[list[Article], Report]:
  """The standard library as articles, one per public module, in sorted module order (deterministic).

  lead = the module docstring's first paragraph (and its second when the first is a one-line summary); one
  section = the module docstring's other paragraphs, then each public function's, class's and method's docstring
  as one passage; links = other stdlib modules the docstrings refer to (see `_module_mentions`).
  """
  stdlib = pathlib.Path(stdlib or sysconfig.get_paths()["stdlib"])
  report = Report(f"stdlib {stdlib}")
  modules = []
  for path in builtin.source_files(stdlib):
    parts = path.relative_to(stdlib).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    try:
      tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError):
      report.totals["unparsable_files"] += 1
      continue
    modules.append((name, tree))
  names = {name for name, _ in modules}
  raw = []
  for name, tree in modules:
    doc = ast.get_docstring(tree)
    paragraphs = _docstring_paragraphs(doc) if doc else []
    one_line_summary = doc and "\n" not in inspect.cleandoc(doc).split("\n\n")[0]
    n_lead = 2 if one_line_summary and len(paragraphs) > 1 else min(1, len(paragraphs))
    lead, body = paragraphs[:n_lead], paragraphs[n_lead:]
    for qualname, _, entry_doc in builtin.entries(tree, name):
      if qualname != name:
        text = " ".join(_docstring_paragraphs(entry_doc))
        if text:
          body.append(text)
    article = Article(name, name, lead, [body] if body else [], [])
    for place in article.passages():
      for target in _module_mentions(article.paragraph(*place), names):
        if target != name:
          _add_mention(article.mentions, target, place)
          if target not in article.links:
            article.links.append(target)
    article.links.sort()
    raw.append(article)
  return _finish(raw, report, check_sentences), report


# ---------------------------------------------------------------------------------------------------------------
# MediaWiki XML dumps

# Sections that hold lists of references and links rather than prose: their links count, their text does not.
SKIP_SECTIONS = frozenset({"see also", "references", "external links", "further reading", "notes", "bibliography",
                           "sources", "citations", "footnotes", "notes and references"})
_DEFAULT_NAMESPACES = {"media", "special", "talk", "user", "user talk", "wikipedia", "project", "file", "image",
                       "mediawiki", "template", "help", "category", "portal", "draft", "module", "wp", "wikt"}
_HEADING = re.compile(r"^(={1,6})\s*(.*?)\s*\1\s*$", re.MULTILINE)
_REDIRECT = re.compile(r"^\s*#redirect\s*:?\s*\[\[([^\]|]+)", re.IGNORECASE)
_DROP_TAGS = frozenset({"ref", "table", "gallery", "math", "references", "timeline", "imagemap", "score",
                        "syntaxhighlight"})


def normalize_title(title: str) -> str:
  """MediaWiki's canonical form: no #fragment, underscores as spaces, single spaces, first letter upper case."""
  title = " ".join(title.split("#", 1)[0].replace("_", " ").split()).lstrip(":").strip()
  return title[:1].upper() + title[1:]


def title_to_id(title: str) -> str:
  return title.replace(" ", "_")


def _open_dump(path: pathlib.Path):
  with open(path, "rb") as f:
    magic = f.read(3)
  if magic == b"BZh":
    return bz2.open(path, "rb")
  if magic[:2] == b"\x1f\x8b":
    return gzip.open(path, "rb")
  return open(path, "rb")


def _local(tag: str) -> str:
  return tag.rsplit("}", 1)[-1]


def _iter_pages(path: pathlib.Path):
  """(namespaces, pages): yields the set of namespace names first, then (title, ns, redirect, text) per page."""
  refuse = f"{path}: not a MediaWiki XML dump"
  namespaces, first, root = set(_DEFAULT_NAMESPACES), True, None
  try:
    with _open_dump(path) as f:
      for event, elem in ET.iterparse(f, events=("start", "end")):
        name = _local(elem.tag)
        if first:
          if name != "mediawiki":
            raise ValueError(f"{refuse}: the root element is <{name}>, not <mediawiki>")
          first, root = False, elem
        if event != "end":
          continue
        if name == "namespace" and elem.text:
          namespaces.add(elem.text.strip().lower())
        elif name == "siteinfo":
          yield namespaces
        elif name == "page":
          fields = {_local(c.tag): c for c in elem}
          title = (fields["title"].text or "") if "title" in fields else ""
          ns = (fields["ns"].text or "0").strip() if "ns" in fields else "0"
          redirect = fields["redirect"].get("title") if "redirect" in fields else None
          text = ""
          revision = fields.get("revision")
          if revision is not None:
            for c in revision:
              if _local(c.tag) == "text":
                text = c.text or ""
          yield title, ns, redirect, text
          root.clear()  # keeps memory flat on a large dump
  except ET.ParseError as e:
    raise ValueError(f"{refuse}: {e}") from e
  except (OSError, EOFError) as e:  # a truncated or corrupt .bz2 / .gz
    raise ValueError(f"{refuse}: {e}") from e
  if first:
    raise ValueError(f"{refuse}: the file is empty")


def _link_target(link, namespaces: set[str]) -> str | None:
  title = normalize_title(str(link.title))
  if not title or (":" in title and title.split(":", 1)[0].strip().lower() in namespaces):
    return None
  return title


def _parse_page(title: str, text: str, namespaces: set[str]):
  """(lead, sections, [(target title, place or None)]) of one page's wikitext."""
  import mwparserfromhell  # pylint: disable=g-import-not-at-top
  code = mwparserfromhell.parse(text)
  for node in code.filter_templates(recursive=False) + code.filter_comments(recursive=False):
    code.remove(node)
  for node in code.filter_tags(matches=lambda n: str(n.tag).lower() in _DROP_TAGS):
    try:
      code.remove(node)
    except ValueError:  # inside a tag already removed
      pass
  for link in code.filter_wikilinks():
    if _link_target(link, namespaces) is None and ":" in str(link.title):  # File:, Category:, ...
      try:
        code.remove(link)
      except ValueError:
        pass
  wikitext = str(code)
  # Split at level-1/2 headings; deeper headings only end a paragraph.
  chunks, starts = [], [m for m in _HEADING.finditer(wikitext) if len(m.group(1)) <= 2]
  chunks.append((None, wikitext[:starts[0].start()] if starts else wikitext))
  for m, nxt in zip(starts, starts[1:] + [None]):
    chunks.append((m.group(2), wikitext[m.end():nxt.start() if nxt else len(wikitext)]))
  lead, sections, links = [], [], []
  for heading, chunk in chunks:
    skip = heading is not None and heading.strip().lower() in SKIP_SECTIONS
    paragraphs = []
    for block in re.split(r"\n\s*\n|^=+[^\n]*=+\s*$", chunk, flags=re.MULTILINE):
      part = mwparserfromhell.parse(block)
      place = None if skip else ((LEAD, len(paragraphs)) if heading is None else (len(sections), len(paragraphs)))
      block_links = [t for t in (_link_target(l, namespaces) for l in part.filter_wikilinks()) if t]
      text = " ".join(part.strip_code(normalize=True, collapse=True).split())
      if skip:
        links += [(t, None) for t in block_links]
        continue
      if not text:  # blank blocks are the separators themselves, not empty passages
        links += [(t, None) for t in block_links]
        continue
      links += [(t, place) for t in block_links]
      paragraphs.append(text)
    if heading is None:
      lead = paragraphs
    elif paragraphs:
      sections.append(paragraphs)
  return lead, sections, links


def read_wikipedia_xml(path, check_sentences: bool = True) -> tuple[list[Article], Report]:
  """Articles (namespace 0, not redirects) of a MediaWiki XML dump, plain, .bz2 or .gz.

  lead = text before the first heading; sections at `== heading ==` (deeper headings stay in their section;
  SKIP_SECTIONS give links but no passages); templates, refs, tables, comments, files and categories stripped.
  Links follow redirects (one hop); the passages holding a link are its mentions. Ids are titles with
  underscores. A file that is not MediaWiki XML raises ValueError naming the file and the reason.
  """
  path = pathlib.Path(path)
  report = Report(str(path))
  pages, redirects, namespaces = [], {}, set(_DEFAULT_NAMESPACES)
  for item in _iter_pages(path):
    if isinstance(item, set):
      namespaces = item
      continue
    title, ns, redirect, text = item
    title = normalize_title(title)
    if ns != "0":
      report.totals["non_article_pages"] += 1
      continue
    m = _REDIRECT.match(text)
    if redirect or m:
      redirects[title] = normalize_title(redirect or m.group(1))
      report.totals["redirects"] += 1
      continue
    pages.append((title, text))
  raw = []
  for title, text in pages:
    lead, sections, links = _parse_page(title, text, namespaces)
    article = Article(title_to_id(title), title, lead, sections, [])
    for target, place in links:
      hops = 0
      while target in redirects and hops < 3:
        target, hops = redirects[target], hops + 1
      report.totals["links_via_redirect"] += hops > 0
      target_id = title_to_id(target)
      if target_id not in article.links:  # a page names the same article many times: not a problem
        article.links.append(target_id)
      if place is not None:
        _add_mention(article.mentions, target_id, place)
    raw.append(article)
  return _finish(raw, report, check_sentences), report
