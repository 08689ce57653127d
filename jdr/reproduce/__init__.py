"""Rebuilds the SciFact table of the hard-negative methods: `python -m jdr.reproduce scifact --out DIR`.

Every choice is made on a dev split of the training queries, every row trains the same budget, and the
test queries are scored once, for the final models:

  rows.py      the rows (chains of recipe stages), the shared budget and each stage's ConfigDict
  devsplit.py  the fixed, seeded dev split of the training queries, written to the output directory
  runs.py      running the stages (skip finished ones, resume killed ones), choosing rates, scoring
  report.py    the markdown table, the CSV of every run and the two plots
  claims.py    the papers' claims, each judged from two rows' test figures paired by seed

The ablations are further experiments of the same command, each one module, with the table's resume (a
stage's record is its finished mark), plan check, progress lines, runs.csv and statistic:

  pretraining.py  `pretrain-ablation`: Chang et al.'s pretraining tasks, each fine-tuned and scored zero-shot
  fgd.py          `fgd-ablation`: FGD's rows on long-document SciFact, the teacher's reranking, MaxP, Eq. 16
  commands.py     running their stages as the public commands, each a process of its own

`__main__.py` is the command line over these.
"""
