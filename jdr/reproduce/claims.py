"""The papers' claims the methods table can test, each judged from the final runs' test figures.

A claim compares two rows on one test metric, paired by seed (seed s of one row against seed s of the
other: the same data order and initial noise). Its gain is the mean of the paired differences and its
spread their sample standard deviation. "X beats Y" holds when the gain is larger than its spread;
"X is at least Y" holds unless X is worse by more than the spread. With three seeds this is a loose test
(a gain of one spread is a t of 1.7), which the table says next to every verdict.
"""

from __future__ import annotations

import dataclasses
import statistics


@dataclasses.dataclass(frozen=True)
class Claim:
  text: str
  row: str  # the row claimed better
  baseline: str  # the row it is compared with
  metric: str  # a key of test.json's "test" record; "{compressed}" is the plan's compressed index
  at_least: bool = False  # "at least as good as" rather than "beats"


CLAIMS = (
    Claim("STAR beats BM25 negatives at the same budget", "star", "bm25_neg", "ndcg@10"),
    Claim("ADORE beats STAR", "adore", "star", "ndcg@10"),
    Claim("ADORE+STAR is at least ADORE", "adore_star", "adore", "ndcg@10", at_least=True),
    Claim("LambdaRank beats RankNet on MRR@10", "adore", "adore_ranknet", "mrr@10"),
    Claim("dynamic negatives (retrieved at every step) beat static ones (retrieved once)", "adore",
          "adore_static", "ndcg@10"),
    # The same loss (RankNet) trained on Flat: the one difference is the index the query tower learns on.
    Claim("training on the compressed index is best when serving from it", "ltre_pq", "adore_ranknet",
          "{compressed}/ndcg@10"),
    # The same budget spent on BM25 negatives throughout, rather than the warm-up model itself (fewer steps).
    Claim("ANCE beats its BM25-negative warm-up continued to the same budget", "ance", "bm25_neg", "ndcg@10"),
    # The same pool, sampler and loss as bm25_neg: the one difference is the candidates the filter dropped.
    Claim("filtering BM25 negatives with a cross-encoder beats leaving them unfiltered", "bm25_neg_ce",
          "bm25_neg", "ndcg@10"),
    Claim("MarginMSE from the cross-encoder, added to the contrastive loss, beats the contrastive loss alone",
          "margin_mse", "bm25_neg", "ndcg@10"),
)


@dataclasses.dataclass(frozen=True)
class Verdict:
  claim: Claim
  metric: str
  seeds: tuple[int, ...]  # the seeds both rows have scored
  gain: float | None = None
  spread: float | None = None

  @property
  def holds(self) -> bool | None:
    """None while fewer than two seeds are paired: one seed has no spread to judge a gain against."""
    if self.gain is None or self.spread is None:
      return None
    return self.gain >= -self.spread if self.claim.at_least else self.gain > self.spread

  def line(self) -> str:
    c = self.claim
    if self.gain is None:
      return f"- {c.text}: not yet scored (needs the final runs of {c.row} and {c.baseline})"
    seeds = ",".join(str(s) for s in self.seeds)
    figure = f"{self.metric} {self.gain:+.4f}"
    if self.spread is None:
      return f"- {c.text}: not judged yet, one seed ({figure}, seed {seeds})"
    verdict = "holds" if self.holds else "does not hold"
    return (f"- {c.text}: **{verdict}** ({figure} ± {self.spread:.4f}, mean ± sample std of the paired "
            f"differences over seeds {seeds})")


def judge(claim: Claim, finals: dict[str, list[dict]], compressed: str) -> Verdict:
  """The verdict on `claim` from {row: final runs' records (each with "seed" and "test")}."""
  metric = claim.metric.format(compressed=compressed)
  by_seed = {name: {r["seed"]: r["test"][metric] for r in finals.get(name, [])
                    if metric in r.get("test", {})} for name in (claim.row, claim.baseline)}
  seeds = tuple(sorted(set(by_seed[claim.row]) & set(by_seed[claim.baseline])))
  if not seeds:
    return Verdict(claim, metric, seeds)
  diffs = [by_seed[claim.row][s] - by_seed[claim.baseline][s] for s in seeds]
  spread = statistics.stdev(diffs) if len(diffs) > 1 else None
  return Verdict(claim, metric, seeds, statistics.mean(diffs), spread)


def judge_all(finals: dict[str, list[dict]], compressed: str) -> list[Verdict]:
  return [judge(c, finals, compressed) for c in CLAIMS]
