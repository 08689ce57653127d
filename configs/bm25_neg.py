"""BM25 negatives ("BM25 Neg", ANCE Table 1 / Gao et al. 2020): one negative per query drawn uniformly from its
BM25 top 100 (mined once with jdr.retrieval.bm25 and cached in the workdir).

The full recipe is ANCE's BM25 warm-up as its authors ran it (microsoft/ANCE `commands/run_train_warmup.sh`,
`drivers/run_warmup.py`, model `rdot_nll`): the model configs/star.py and configs/ance.py start from
(`runs/msmarco-bm25-warmup`), and the "open-sourced BM25 Neg model" of STAR's baselines (Sec. 7.3). The rows
not below are configs/inbatch.py's (data, starting model, towers; its table gives their sources).

| setting | value (full) | value (runlocal) | source | departs / why |
|---|---|---|---|---|
| negatives | 1 uniform from the query's BM25 top 100, no in-batch negatives | 1 from the BM25 top 100, plus the batch's other documents | ANCE Sec. 5 ("random sampling from BM25 top 100"); ANCE `rdot_nll` (one two-way softmax per triple) | full: jdr mines BM25 itself (jdr.retrieval.bm25, Anserini k1 0.9, b 0.4) where run_warmup.py reads MS MARCO's `triples.train.small.tsv`; runlocal: in-batch kept, what docs/results.md's table ran |
| loss | NLL of the positive over (positive, negative), temperature 1 | softmax NLL over the positive, the negative and the batch, temperature 0.05 | ANCE `rdot_nll`; Appendix A.1 | runlocal: cosines in [-1, 1] need the temperature |
| optimizer | `lamb` 2e-4, 1,000 warm-up steps then linear decay, no weight decay, clip 1.0 | AdamW 1e-4, 20 warm-up steps (configs/inbatch.py's) | run_train_warmup.sh (`--optimizer lamb --learning_rate 2e-4 --warmup_steps 1000`); run_warmup.py defaults (`--weight_decay 0.0`, `--max_grad_norm 1.0`) | runlocal: the rate `python -m jdr.reproduce scifact` chose for this row on a dev split of the training queries (each rate's dev nDCG@10: docs/results.md, "SciFact methods at one budget") |
| batch | 32 triples | 32 | run_train_warmup.sh (`--per_gpu_train_batch_size=32`, one process) | |
| lengths | 128 tokens, queries and passages | 32 / 128 (configs/inbatch.py's) | run_train_warmup.sh (`--max_seq_length 128`, every text of a triple) | |
| steps | 2,187,500 | 208 (configs/inbatch.py's) | run_warmup.py: `expected_train_size` 35,000,000 // 32 x 2 epochs | runlocal: jdr.reproduce's budget |

  python -m jdr.train --config configs/bm25_neg.py:runlocal --workdir runs/bm25_neg
  python -m jdr.train --config configs/bm25_neg.py --workdir runs/msmarco-bm25-warmup
"""

import base
import inbatch

ARGS = dict(runlocal=False)


def get_config(arg=None):
  a = base.parse_arg(arg, **ARGS)
  c = inbatch.recipe(a)
  c.negatives.source = "bm25"
  c.negatives.per_query = 1
  c.negatives.bm25.top_k = 100
  c.loss.name = "softmax_nll"
  if not a.runlocal:
    c.negatives.in_batch = False
    c.batch_size = 32
    c.data.query_max_length = c.data.doc_max_length = 128
    c.optimizer.learning_rate = 2e-4
    c.optimizer.warmup_steps = 1000
    c.optimizer.weight_decay = 0.0
    c.num_train_steps = 35_000_000 // 32 * 2
  return c
