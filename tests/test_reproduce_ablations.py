"""The two ablations as experiments of `python -m jdr.reproduce`: their tables (the mean ± sample std over
seeds, claims paired by seed) on hand-made records, their plans kept by an output directory, and each command
end to end in its tiny mode (a tiny random BERT on the built-in data; a re-run runs nothing)."""

import csv
import json

import pytest

from jdr.reproduce import commands
from jdr.reproduce import fgd
from jdr.reproduce import pretraining


def _write(path, record):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(record))


def test_pretrain_ablation_table_is_the_mean_and_sample_std_over_seeds(tmp_path):
  def record(row, seed, value):
    test = {f"{k}/{m}": value for k in ("scifact_all", "scifact_10pct") for m in ("ndcg@10", "recall@100")}
    test.update({f"reqa/recall@{k}": value / 2 for k in (1, 5, 10, 100)})
    return {"run": pretraining.run_name(row, seed), "method": row, "seed": None if row == "bm25" else seed,
            "steps": 250, "test": test, "seconds": 1.0}
  for row, seed, value in (("ict", 0, 0.4), ("ict", 1, 0.5), ("none", 0, 0.3), ("none", 1, 0.3),
                           ("bm25", 0, 0.6)):
    _write(tmp_path / "runs" / pretraining.run_name(row, seed) / "done.json", record(row, seed, value))
  text = pretraining.write_report(pretraining.Plan(), tmp_path)
  # Rows in the paper's order; sample std of (0.4, 0.5) = 0.0707; BM25 ran once.
  assert "| none | 0,1 | 0.3000 ± 0.0000 |" in text
  assert "| ict | 0,1 | 0.4500 ± 0.0707 | 0.4500 ± 0.0707 |" in text
  assert "| bm25 | — | 0.6000 | 0.6000 |" in text and text.index("| none |") < text.index("| ict |")
  # Paired gains 0.1 and 0.2: mean 0.15, std 0.0707.
  assert "- ICT pretraining beats no pretraining: **holds** (scifact_10pct/ndcg@10 +0.1500 ± 0.0707" in text
  with open(tmp_path / "runs.csv") as f:
    lines = list(csv.DictReader(f))
  assert [l["run"] for l in lines] == ["none_s0", "none_s1", "ict_s0", "ict_s1", "bm25"]
  assert float(lines[3]["test_scifact_all/ndcg@10"]) == 0.5 and lines[4]["seed"] == ""


def test_fgd_ablation_table_is_the_mean_and_sample_std_over_seeds(tmp_path):
  metrics = lambda v: {"mrr@100": v, "ndcg@10": v + 0.1, "recall@100": v + 0.2}
  for name, v in (("fgd_s0", 0.3), ("fgd_s1", 0.5), ("contrastive_s0", 0.2), ("contrastive_s1", 0.2),
                  ("warmup_s0", 0.1)):
    row, seed = name.rsplit("_s", 1)
    _write(tmp_path / "runs" / name / "done.json", {"run": name, "method": row, "seed": int(seed), "steps": 120,
                                                    "test": metrics(v), "seconds": 1.0})
  _write(tmp_path / "runs" / "rerank" / "done.json", {
      "run": "rerank", "method": "rerank", "first_stage": "minilm",
      "test": {**{f"first_stage/{k}": v for k, v in metrics(0.6).items()},
               **{f"rerank@10/{k}": v for k, v in metrics(0.7).items()}, "rerank@10/ms_per_query": 12.5}})
  _write(tmp_path / "runs" / "fgd_s0" / "extras.json", {"firstp": metrics(0.3), "maxp": metrics(0.4)})
  text = fgd.write_report(fgd.Plan(), tmp_path)
  assert "| rerank@10 | 0.8000 | 0.7000 | 12.5 |" in text and "| first_stage | 0.7000 | 0.6000 | — |" in text
  assert "| stage 1 only (the warm-up every row starts from) | 0 | 0.1000 | 0.2000 | 0.3000 |" in text
  assert "| contrastive only | 0,1 | 0.2000 ± 0.0000 |" in text
  assert "| FGD (passage + sentence, Eq. 7) | 0,1 | 0.4000 ± 0.1414 | 0.5000 ± 0.1414 | 0.6000 ± 0.1414 |" in text
  assert "| maxp | 0.4000 | 0.5000 | 0.6000 |" in text
  assert "- FGD beats contrastive training alone: **holds** (ndcg@10 +0.2000 ± 0.1414" in text
  with open(tmp_path / "runs.csv") as f:
    lines = {l["run"]: l for l in csv.DictReader(f)}
  assert float(lines["rerank"]["test_rerank@10/ms_per_query"]) == 12.5
  assert float(lines["fgd_s0"]["extras_maxp/ndcg@10"]) == 0.5 and lines["fgd_s1"]["extras_maxp/ndcg@10"] == ""


def test_an_ablation_directory_keeps_its_plan_and_bad_rows_are_refused(tmp_path, capsys):
  from jdr.reproduce import __main__ as command  # pylint: disable=g-import-not-at-top
  from jdr.reproduce import rows as rows_lib  # pylint: disable=g-import-not-at-top
  import dataclasses  # pylint: disable=g-import-not-at-top
  plan = fgd.Plan(overrides=("model.encode_chunk_rows=4",))
  rows_lib.record_plan(plan, tmp_path, free=("seeds",))
  rows_lib.record_plan(dataclasses.replace(plan, seeds=(7,)), tmp_path, free=("seeds",))  # adds runs only
  with pytest.raises(ValueError, match="overrides"):
    rows_lib.record_plan(dataclasses.replace(plan, overrides=()), tmp_path, free=("seeds",))
  assert rows_lib.recorded_plan(fgd.Plan(), tmp_path) == dataclasses.replace(plan, seeds=(7,))  # what a report states
  assert rows_lib.recorded_plan(fgd.Plan(), tmp_path / "none") == fgd.Plan()
  for argv, message in ((["pretrain-ablation", "--methods", "ict,dpr"], "unknown row(s) dpr"),
                        (["fgd-ablation", "--methods", "contrastive"], "--extras-row fgd is not among"),
                        (["fgd-ablation", "--set", "steps"], "expected KEY=VALUE")):
    with pytest.raises(SystemExit):
      command.main(argv + ["--out", str(tmp_path / "x")])
    assert message in capsys.readouterr().err
  assert not (tmp_path / "x").exists()


def _refuse(*args, **kwargs):
  raise AssertionError(f"a finished stage ran again: {args}")


@pytest.mark.long
def test_pretrain_ablation_tiny_end_to_end_and_rerun_skips(tmp_path, monkeypatch, capsys, commands_in_process):
  from jdr.reproduce import __main__ as command  # pylint: disable=g-import-not-at-top
  out = tmp_path / "ablation"
  argv = ["pretrain-ablation", "--out", str(out), "--tiny", "--methods", "ict,bm25", "--seeds", "0"]
  command.main(argv)
  printed = capsys.readouterr().out
  assert "run 1 of 2: ict_s0: pretrain 2 steps" in printed and "run 2 of 2: bm25" in printed
  record = json.loads((out / "runs" / "ict_s0" / "done.json").read_text())
  assert set(record["stage_seconds"]) == {"pretrain", "scifact_all", "scifact_10pct", "reqa"}
  assert all(0.0 <= record["test"][key] <= 1.0 for key, _ in pretraining.COLUMNS)
  table = (out / "table.md").read_text()
  assert "| ict | 0 |" in table and "| bm25 | — |" in table
  assert json.loads((out / "device.json").read_text())["platform"] == "cpu"
  with monkeypatch.context() as m:  # a second call runs nothing and writes the same table
    m.setattr(commands, "run_command", _refuse)
    m.setattr(pretraining, "bm25_row", _refuse)
    command.main(argv)
  assert capsys.readouterr().out.count("finished before, skipped") == 2
  assert (out / "table.md").read_text() == table
  # A row stopped after its pretraining goes on from its next stage.
  (out / "runs" / "ict_s0" / "done.json").unlink()
  (out / "runs" / "ict_s0" / "reqa.json").unlink()
  ran = []
  real = commands.run_command
  monkeypatch.setattr(commands, "run_command", lambda cmd, log: ran.append(cmd[2]) or real(cmd, log))
  command.main(argv)
  assert ran == ["jdr.encode", "jdr.retrieve", "jdr.evaluate"]
  assert json.loads((out / "runs" / "ict_s0" / "done.json").read_text())["test"] == record["test"]


@pytest.mark.long
def test_fgd_ablation_tiny_end_to_end_and_rerun_skips(tmp_path, monkeypatch, capsys, commands_in_process):
  from jdr.reproduce import __main__ as command  # pylint: disable=g-import-not-at-top
  out = tmp_path / "fgd"
  argv = ["fgd-ablation", "--out", str(out), "--tiny", "--methods", "fgd", "--single-seed-methods", "",
          "--seeds", "0", "--jobs", "2", "--backend", "jax"]
  command.main(argv)
  printed = capsys.readouterr().out
  assert "of 5: train fgd_s0" in printed and "of 5: FirstP, MaxP and the Eq. 16 ensemble of fgd_s0" in printed
  assert json.loads((out / "data" / "scifact-long" / "stats.json").read_text())["abstracts"] == 1200
  rerank = json.loads((out / "runs" / "rerank" / "done.json").read_text())
  assert rerank["first_stage"].endswith("warmup_s0") and rerank["test"]["rerank@10/ms_per_query"] > 0
  row = json.loads((out / "runs" / "fgd_s0" / "done.json").read_text())
  assert row["after"] == "warmup_s0" and 0.0 <= row["test"]["ndcg@10"] <= 1.0
  extras = json.loads((out / "runs" / "fgd_s0" / "extras.json").read_text())
  assert set(extras) == {"firstp", "maxp", "ensemble_gamma_0.3"}
  table = (out / "table.md").read_text()
  assert "| FGD (passage + sentence, Eq. 7) | 0 |" in table and "| rerank@10 |" in table
  with open(out / "runs.csv") as f:
    assert [l["run"] for l in csv.DictReader(f)] == ["cross-encoder", "rerank", "warmup_s0", "fgd_s0"]
  with monkeypatch.context() as m:
    m.setattr(commands, "run_command", _refuse)
    command.main(argv)
  assert capsys.readouterr().out.count("finished before, skipped") == 5
  assert (out / "table.md").read_text() == table


def test_inbatch_ablation_table_and_claims_paired_by_seed(tmp_path):
  from jdr.reproduce import inbatch  # pylint: disable=g-import-not-at-top
  def record(row, seed, full, narrow):
    test = {"ndcg@10": full, "mrr@10": full, "recall@100": 0.9,
            **{f"dim{w}/{m}": narrow for w in (256, 128, 64) for m in ("ndcg@10", "mrr@10", "recall@100")}}
    return {"run": f"{row}_s{seed}", "method": row, "seed": seed, "rate": 1e-4, "steps": 208,
            "test": test, "masked_by_guide": 3.0 if row == "guided" else None,
            "seconds": 1.0}
  for row, seed, full, narrow in (("inbatch", 0, 0.70, 0.50), ("inbatch", 1, 0.72, 0.52),
                                  ("matryoshka", 0, 0.71, 0.66), ("matryoshka", 1, 0.72, 0.70),
                                  ("dim64", 0, 0.40, 0.65), ("dim64", 1, 0.40, 0.66),
                                  ("guided", 0, 0.71, 0.5), ("guided", 1, 0.74, 0.5)):
    _write(tmp_path / "runs" / f"{row}_s{seed}" / "done.json", record(row, seed, full, narrow))
  text = commands.write_outputs(tmp_path, inbatch.table_markdown(inbatch.Plan(), tmp_path), inbatch.write_csv)
  assert "| + Matryoshka 384,256,128,64 | 0,1 | 0.7150 ± 0.0071 | 0.6800 ± 0.0283 |" in text
  assert "| + guide: the starting MiniLM, frozen | 0,1 |" in text and "| 3.0000 ± 0.0000 |" in text
  # guided - inbatch: +0.01, +0.02 -> mean 0.015, std 0.0071: holds.
  assert ("- masking what the frozen starting model ranks above the positive helps: **holds** "
          "(ndcg@10 +0.0150 ± 0.0071") in text
  # matryoshka - dim64 at 64: +0.01, +0.04 -> 0.025 ± 0.0212: holds.
  assert "- Matryoshka at 64 against a model trained at 64 alone: **holds** (dim64/ndcg@10 +0.0250 ± 0.0212" in text
  assert "- Matryoshka at 384 is at least training at 384 alone: **holds**" in text
  with open(tmp_path / "runs.csv") as f:
    lines = {l["run"]: l for l in csv.DictReader(f)}
  assert float(lines["dim64_s1"]["test_dim64/ndcg@10"]) == 0.66


@pytest.mark.long
def test_inbatch_ablation_tiny_end_to_end_and_rerun_skips(tmp_path, capsys):
  from jdr.reproduce import __main__ as command  # pylint: disable=g-import-not-at-top
  out = tmp_path / "inbatch"
  argv = ["inbatch-ablation", "--out", str(out), "--tiny", "--methods", "inbatch,matryoshka,guided"]
  command.main(argv)
  assert "run 3 of 3: guided_s0" in capsys.readouterr().out
  row = json.loads((out / "runs" / "matryoshka_s0" / "done.json").read_text())
  assert row["overrides"] == {"loss.matryoshka_dims": "64,42,21,10"}
  assert {"ndcg@10", "dim42/ndcg@10", "dim21/ndcg@10", "dim10/ndcg@10"} <= set(row["test"])
  assert json.loads((out / "runs" / "guided_s0" / "done.json").read_text())["masked_by_guide"] is not None
  table = (out / "table.md").read_text()
  command.main(argv)
  assert capsys.readouterr().out.count("finished before, skipped") == 3
  assert (out / "table.md").read_text() == table
