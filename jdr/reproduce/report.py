"""The table's outputs, from what the runs wrote: table.md, runs.csv, dev_curves.png, test_ndcg.png.

Everything is read back from OUT (done.json, test.json, choices.json), so the report of a table built over
several sittings, or in parts, is the same as that of one sitting. A row's figures are the mean and the
sample standard deviation over the seeds scored so far at its chosen rate.
"""

from __future__ import annotations

import csv
import json
import pathlib
import statistics

from jdr.runtime import atomic
from jdr.reproduce import claims as claims_lib
from jdr.reproduce import rows as rows_lib
from jdr.reproduce import runs as runs_lib


def _records(out: pathlib.Path) -> list[dict]:
  """Every finished stage (done.json), with its test.json merged in when it was scored; the start first."""
  records = []
  start = runs_lib.read_json(out / "runs" / "start" / "test.json")
  if start is not None:
    records.append({"run": "start", "method": "start", "steps": 0, **start})
  for done in sorted((out / "runs").glob("*/*/done.json")):
    record = json.loads(done.read_text())
    scored = runs_lib.read_json(done.parent / "test.json")
    records.append({**record, **(scored or {})})
  return records


def final_runs(plan: rows_lib.Plan, out: pathlib.Path) -> dict[str, list[dict]]:
  """{row: the scored records of its final runs (the chosen rate), one per seed}; the start's alone."""
  records = {r["run"]: r for r in _records(out)}
  grid = runs_lib.read_json(out / "choices.json") or {}
  choices = {name: float(g["rate"]) for name, g in grid.items()}
  seeds = sorted({r["seed"] for r in records.values() if "seed" in r})
  result = {}
  for row in rows_lib.rows(plan):
    if not row.stages:
      result[row.name] = [records["start"]] if "start" in records else []
      continue
    if row.name not in choices or any(s.method not in choices for s in row.stages[:-1]):
      continue
    names = [runs_lib.chain_for(row, choices[row.name], s, choices).name for s in seeds]
    found = [records[n] for n in names if n in records and "test" in records[n]]
    if found:
      result[row.name] = found
  return result


def mean_std(values: list[float]) -> str:
  """The one statistic of every experiment's table: the mean ± the sample standard deviation over the seeds
  (their figure alone for one seed, "—" for none)."""
  if not values:
    return "—"
  if len(values) == 1:
    return f"{values[0]:.4f}"
  return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def table_markdown(plan: rows_lib.Plan, out: pathlib.Path) -> str:
  finals = final_runs(plan, out)
  grid = runs_lib.read_json(out / "choices.json") or {}
  split = runs_lib.read_json(next((out / "data").glob("*-dev/split.json"), out / "none"))
  labels = {r.name: r.label for r in rows_lib.rows(plan)}
  cq = plan.compressed
  lines = [f"# {'SciFact' if not plan.tiny else 'Built-in (tiny model)'}: the methods at one budget", ""]
  if split:
    lines.append(f"Dev: {len(split['dev_queries'])} of the {len(split['dev_queries']) + split['train_queries']} "
                 f"training queries (fraction {split['fraction']}, seed {split['seed']}); every row trains on the "
                 "rest. Rates are chosen on dev nDCG@10 of seed 0 after the whole budget; test is scored once, "
                 "for the final models (the last step of each).")
    lines.append("")
  lines += [rows_lib.budget_text(plan), ""]
  lines += ["| row | rate (chosen on dev) | dev nDCG@10 | test nDCG@10 | test MRR@10 | test Recall@100 | "
            f"test nDCG@10 on {cq} | seeds |", "|---|---|---|---|---|---|---|---|"]
  for name, found in finals.items():
    if not found:
      continue
    col = lambda key, part="test": [r[part][key] for r in found if key in r.get(part, {})]
    if name == "start":
      rate, dev = "—", f"{found[0]['dev']['ndcg@10']:.4f}"
    else:
      rate = f"{float(grid[name]['rate']):g}"
      dev = grid[name]["dev_ndcg@10"].get(rate)  # a given rate's: once its seed 0 has trained here
      dev = "—" if dev is None else f"{dev:.4f}"
    seeds = "—" if name == "start" else ",".join(str(r["seed"]) for r in found)
    lines.append(f"| {labels[name]} | {rate} | {dev} | {mean_std(col('ndcg@10'))} | {mean_std(col('mrr@10'))} | "
                 f"{mean_std(col('recall@100'))} | {mean_std(col(f'{cq}/ndcg@10'))} | {seeds} |")
  lines += ["", f"The LTRe-style row trains on {cq} and its dev figure is measured there; its test figures are "
            f"on Flat in the middle columns and on {cq} in the last one, which is filled for the rows that keep "
            "a fixed document index (the ADORE rows, LTRe) and the start. Mean ± sample standard deviation "
            "over seeds.", ""]
  if any("zero_shot" in r for found in finals.values() for r in found):
    start = finals.get("start", [{}])[0].get("zero_shot", {}) if finals.get("start") else {}
    lines += ["## Zero-shot (trained on SciFact, scored on reqa-squad-sample)", "",
              "| row | Recall@1 | Recall@5 | Recall@100 | nDCG@10 | nDCG@10 − start |", "|---|---|---|---|---|---|"]
    for name, found in finals.items():
      zs = [r["zero_shot"] for r in found if "zero_shot" in r]
      if not zs:
        continue
      col = lambda key: [z[key] for z in zs]
      delta = [z["ndcg@10"] - start["ndcg@10"] for z in zs] if start and name != "start" else []
      lines.append(f"| {labels[name]} | {mean_std(col('recall@1'))} | {mean_std(col('recall@5'))} | "
                   f"{mean_std(col('recall@100'))} | {mean_std(col('ndcg@10'))} | {mean_std(delta)} |")
    lines.append("")
  lines += mined_section(out)
  lines += ["## Claims (test, paired by seed)", ""]
  lines += [v.line() for v in claims_lib.judge_all(finals, cq)]
  lines += ["", "A claim that X beats Y holds when the mean paired gain is larger than the sample std of the paired "
            "gains; \"at least\" holds unless X is worse by more than that std.", ""]
  if grid:
    rates = [f"{r:g}" for r in plan.rates]
    lines += ["## Dev nDCG@10 of each rate (seed 0)", "", "| row | " + " | ".join(rates) + " | chosen |",
              "|---|" + "---|" * (len(rates) + 1)]
    for name in (r.name for r in rows_lib.rows(plan)):
      if name in grid:
        values = grid[name]["dev_ndcg@10"]
        lines.append(f"| {labels[name]} | " + " | ".join(f"{values[r]:.4f}" if r in values else "—" for r in rates)
                     + f" | {float(grid[name]['rate']):g}{' (given)' if grid[name].get('given') else ''} |")
  return "\n".join(lines) + "\n"


def mined_section(out: pathlib.Path) -> list[str]:
  """The cross-encoder and the mining of the mined rows: the teacher's dev figures, what the filter dropped, and
  the dev report the threshold was chosen on."""
  teacher = runs_lib.read_json(runs_lib.teacher_dir(out) / "done.json")
  if teacher is None:
    return []
  dev = teacher["dev"]
  lines = ["## The mined rows' cross-encoder and negatives", "",
           f"Cross-encoder: configs/cross_encoder.py:runlocal, {teacher['steps']} steps at {teacher['rate']:g}, seed "
           f"{teacher['seed']}, on the rows' training queries ({teacher['seconds']:.0f} s). Reranking BM25's top 100 "
           "of the dev queries: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(dev.items())) + ".", ""]
  done = runs_lib.mined_done(out)
  if not done.exists():
    return lines + ["The mining has not finished.", ""]
  filtered = json.loads(done.read_text())["report"]
  unfiltered = json.loads((rows_lib.mined_dir(out / "data", "margin_mse") / "meta.json").read_text())["report"]
  chosen = filtered["chosen_on_dev"]["ce_threshold"]
  lines.append(f"Mined: BM25's top {unfiltered['depth']} of {unfiltered['queries']} training queries, "
               f"{unfiltered['training']['candidates']:,} candidates, {unfiltered['training']['dropped']['positives']:,}"
               f" of them labeled positives (dropped), {unfiltered['negatives']:,} negatives scored by the "
               f"cross-encoder ({unfiltered['seconds']:.0f} s). The threshold chosen on dev, {chosen:g}, dropped "
               f"{filtered['training']['dropped'].get('ce_threshold', 0):,} of them, leaving {filtered['negatives']:,} "
               f"({filtered['queries_without_negatives']} queries with none).")
  d = unfiltered.get("dev")
  if d:
    lines += ["", f"Dev ({d['queries']} queries, {d['candidates']:,} candidates, {d['positives_among_candidates']} "
              "labeled positives among them), the cross-encoder threshold alone (FN rate: labeled positives among "
              "the candidates kept; chosen: the best F1 at dropping them):", "",
              "| threshold | dropped | FN rate | positives dropped | F1 |", "|---|---|---|---|---|",
              f"| none | 0.00% | {d['unfiltered']['false_negative_rate']:.2%} | 0.00% | — |"]
    for value, r in d.get("ce_threshold", {}).items():
      mark = " (chosen)" if float(value) == chosen else ""
      lines.append(f"| {value}{mark} | {r['dropped']:.2%} | {r['false_negative_rate']:.2%} | "
                   f"{r['positives_dropped']:.2%} | {r.get('f1', float('nan')):.3f} |")
  return lines + [""]


def flat(prefix: str, values: dict | None) -> dict:
  """A record's figures as CSV columns: {PREFIX + name: value}."""
  return {f"{prefix}{k}": v for k, v in (values or {}).items()}


def write_csv(out: pathlib.Path) -> pathlib.Path:
  """runs.csv: one line per finished stage (grid, warm-up and final runs alike), scored ones with test. It
  holds all that done.json and test.json hold (the dev curve as JSON), so `import_records` can restore a
  table's records from it in another output directory."""
  lines = []
  for r in _records(out):
    line = {k: r.get(k, "") for k in ("run", "method", "steps", "batch_size", "rate", "seed", "after", "parent",
                                      "seconds", "score_seconds")}
    line["dev_curve"] = json.dumps(r["dev_curve"]) if "dev_curve" in r else ""
    line.update(flat("dev_", r.get("dev")))
    line.update(flat("test_", r.get("test")))
    line.update(flat("zero_shot_", r.get("zero_shot")))
    lines.append(line)
  return write_rows_csv(out / "runs.csv", lines)


def write_rows_csv(path: pathlib.Path, lines: list[dict]) -> pathlib.Path:
  """Writes one CSV line per run record (the columns in the order they first appear, empty where a record
  lacks one) atomically: every experiment's runs.csv."""
  fields = []
  for line in lines:
    fields += [k for k in line if k not in fields]

  def write(f):
    import io  # pylint: disable=g-import-not-at-top
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=fields, restval="")
    writer.writeheader()
    writer.writerows(lines)
    f.write(text.getvalue().encode("utf-8"))

  atomic.write_atomic(path, write)
  return path


def import_records(csv_path: pathlib.Path, out: pathlib.Path) -> int:
  """Restores the done.json / test.json of every run in a runs.csv that an earlier build wrote (the table's
  committed record) into OUT/runs, so those runs count as finished here; a record already in OUT is kept.
  Imported stages have no weights here: a stage that needs one as its warm-up retrains it (`runs.train`).
  The inverse of `write_csv`.
  Returns how many records were written."""
  written = 0
  with open(csv_path, newline="", encoding="utf-8") as f:
    reader = csv.DictReader(f)
    missing = {"run", "method", "steps"} - set(reader.fieldnames or ())
    if missing:
      raise ValueError(f"{csv_path}: not a jdr.reproduce runs.csv (no {', '.join(sorted(missing))} column)")
    for line_no, line in enumerate(reader, start=2):
      try:
        parts = {"dev": {}, "test": {}, "zero_shot": {}}
        for key, value in line.items():
          prefix = next((p for p in ("zero_shot_", "dev_", "test_") if key.startswith(p)), None)
          if prefix and key != "dev_curve" and value != "":
            parts[prefix[:-1]][key[len(prefix):]] = float(value)
        if line["run"] == "start":
          done, scored = None, {"dev": parts["dev"], "test": parts["test"]}
          workdir = out / "runs" / "start"
        else:
          done = {"run": line["run"], "method": line["method"], "after": line.get("after", ""),
                  "parent": line.get("parent", ""), "dev": parts["dev"],
                  "dev_curve": [tuple(p) for p in json.loads(line.get("dev_curve") or "[]")], "imported": True}
          done.update({k: int(line[k]) for k in ("steps", "batch_size", "seed") if line.get(k, "") != ""})
          done.update({k: float(line[k]) for k in ("rate", "seconds") if line.get(k, "") != ""})
          scored = {"test": parts["test"]} if parts["test"] else None
          workdir = out / "runs" / line["run"]
        if scored is not None:
          if parts["zero_shot"]:
            scored["zero_shot"] = parts["zero_shot"]
          if line.get("score_seconds"):
            scored["score_seconds"] = float(line["score_seconds"])
      except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{csv_path}:{line_no}: run {line.get('run')!r}: {e}") from None
      for name, record in (("done.json", done), ("test.json", scored)):
        if record is not None and not (workdir / name).exists():
          workdir.mkdir(parents=True, exist_ok=True)
          atomic.write_text(workdir / name, json.dumps(record, indent=1))
          written += 1
  return written


def chain_curve(records: dict[str, dict], record: dict) -> list[tuple[int, float]]:
  """Dev nDCG@10 against the row's step: the warm-up stages' curves first, each later stage shifted by the
  steps before it. `records`: every finished stage by run name."""
  chain = [record]
  while chain[0].get("parent"):
    chain.insert(0, records[chain[0]["parent"]])
  points, offset = {}, 0
  for stage in chain:
    for step, value in stage["dev_curve"]:
      points[offset + step] = value
    offset += stage["steps"]
  return sorted(points.items())


def plot(plan: rows_lib.Plan, out: pathlib.Path) -> list[pathlib.Path]:
  """dev_curves.png (dev nDCG@10 against step, mean and min-max over seeds) and test_ndcg.png (test nDCG@10
  per row, mean with sample-std error bars and each seed as a dot)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  finals = {k: v for k, v in final_runs(plan, out).items() if v}
  labels = {r.name: r.label for r in rows_lib.rows(plan)}
  records = {r["run"]: r for r in _records(out)}

  fig, ax = plt.subplots(figsize=(9, 5.5))
  for name, found in finals.items():
    if name == "start":
      ax.axhline(found[0]["dev"]["ndcg@10"], color="gray", linestyle=":", label=labels[name])
      continue
    curves = [dict(chain_curve(records, r)) for r in found]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    values = np.array([[c[s] for s in steps] for c in curves])
    line, = ax.plot(steps, values.mean(axis=0), marker="o", markersize=3, label=f"{labels[name]} (n={len(curves)})")
    if len(curves) > 1:
      ax.fill_between(steps, values.min(axis=0), values.max(axis=0), color=line.get_color(), alpha=0.15)
  ax.set_xlabel(f"training step (batch {plan.batch_size}; warm-up stages included)")
  ax.set_ylabel("dev nDCG@10")
  ax.set_title("Dev nDCG@10 during training: mean over seeds, band = min to max")
  ax.legend(fontsize=7, loc="lower right")
  ax.grid(alpha=0.3)
  curves_path = out / "dev_curves.png"
  fig.tight_layout()
  fig.savefig(curves_path, dpi=120)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(9, 5))
  names = list(finals)
  means, errs = [], []
  for i, name in enumerate(names):
    values = [r["test"]["ndcg@10"] for r in finals[name]]
    means.append(float(np.mean(values)))
    errs.append(float(np.std(values, ddof=1)) if len(values) > 1 else 0.0)
    ax.scatter([i + 0.15] * len(values), values, color="gray", s=10, zorder=3)
  # Points, not bars: the rows differ by a few points of nDCG@10, which bars from 0 would flatten.
  ax.errorbar(range(len(names)), means, yerr=errs, fmt="o", capsize=5, color="tab:blue", zorder=4)
  ax.set_xticks(range(len(names)), [labels[n] for n in names], rotation=35, ha="right", fontsize=8)
  ax.set_ylabel("test nDCG@10 (Flat)")
  ax.set_title("Test nDCG@10 per row: mean, sample std over seeds, each seed a dot")
  ax.grid(axis="y", alpha=0.3)
  test_path = out / "test_ndcg.png"
  fig.tight_layout()
  fig.savefig(test_path, dpi=120)
  plt.close(fig)
  return [curves_path, test_path]


def write_report(plan: rows_lib.Plan, out: pathlib.Path) -> str:
  """Writes table.md, runs.csv and both plots; returns the table's markdown."""
  text = table_markdown(plan, out)
  atomic.write_text(out / "table.md", text)
  write_csv(out)
  plot(plan, out)
  return text
