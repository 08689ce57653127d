"""ADORE+STAR (Zhan et al., SIGIR 2021, Table 2's best row): ADORE's query-tower training over the fixed
index of a STAR-trained document tower. Train STAR first, then start ADORE from its workdir:

  python -m jdr.train --config configs/star.py:runlocal --workdir runs/star \\
      --config.data.dataset=../shared/data/scifact --config.eval.doc_max_length=256
  python -m jdr.train --config configs/adore_star.py:runlocal --workdir runs/adore_star \\
      --config.data.dataset=../shared/data/scifact --config.model.init_from=runs/star

The STAR model's shared tower is split: its copy on the document side is frozen and indexes the corpus, its
copy on the query side trains. Every setting not in the table is ADORE's (configs/adore.py: the appended
positives, the position weights, MRR@200 in full, AdamW 5e-6 with 2,000 warm-up steps, 64 query tokens), and
every argument of configs/adore.py applies. The full recipe starts from the STAR model DRhard released:

  python -m jdr.train --config configs/adore_star.py --workdir runs/msmarco-adore-star \\
      --config.data.dataset=data/msmarco-passage \\
      --config.model.init_from=models/drhard/star --config.model.doc_init_from=models/drhard/star

| setting | full | runlocal | source | where jdr departs, and why |
|---|---|---|---|---|
| starting model | DRhard's released STAR model, for both towers: the query encoder starts from it (`model.init_from`) and the fixed index is its document encoder (`model.doc_init_from`), default `models/drhard/star` each | `runs/star` from configs/star.py:runlocal, its shared tower split in two | paper Sec. 6.3 ("using STAR to train the document encoder and using ADORE to further train the query encoder"); DRhard README (`adore/train.py --init_path ./data/passage/trained_models/star --pembed_path ./data/passage/evaluate/star/passages.memmap`) | runlocal: jdr's own STAR run |
| where it is published | DRhard README, passage table, STAR's "Model": https://drive.google.com/drive/folders/1bJw8P15cFiV239mTgFQxVilXMWqzqXUU; the trained ADORE+STAR query encoder is "ADORE (STAR)"'s Model, https://drive.google.com/drive/folders/1C1GQGfI4UHg99rfRcPYzQxlGZXvtsDfm (what this recipe trains; docs/results.md scores it) | none | DRhard README (Retrieval Results and Trained Models) | |
| its format | DRhard's `RobertaDot`: config.json and pytorch_model.bin with `roberta.*` (no pooler), `embeddingHead.{weight,bias}` (Linear 768->768) and `norm.{weight,bias}` (LayerNorm) on [CLS], no normalization; roberta-base's tokenizer (transformers 2.x behaviour, lowercased) | a jdr workdir | DRhard `model.py`, `adore/train.py` (`save_model`: config.json + pytorch_model.bin) | |
| what you pass | the downloaded folder that holds config.json, for each tower: `--config.model.init_from=models/drhard/star --config.model.doc_init_from=models/drhard/star` (a missing folder is refused in one line naming the download); jdr's own STAR instead: `--config.model.init_from=runs/msmarco-star --config.model.doc_init_from=` (a jdr workdir holds both towers) | `--config.model.init_from=runs/star` | | |
| data | MS MARCO passage | SciFact train | DRhard README | runlocal: offline |
| learning rate | 5e-6 | 1e-4 | DRhard adore/train.py | runlocal: the rate a dev split of the training queries chose in `python -m jdr.reproduce scifact` |
| steps | 60,000 | 208 (104 in `python -m jdr.reproduce scifact`, after 52 of BM25 negatives and 52 of STAR) | ADORE's (configs/adore.py) | runlocal: the reproduction shares one budget along the chain |
"""

import adore
import base

ARGS = adore.ARGS


def get_config(arg=None):
  a = base.parse_arg(arg, **ARGS)
  c = adore.recipe(a)
  if a.runlocal:
    c.model.init_from, c.model.description = "runs/star", "a STAR model: the workdir of configs/star.py:runlocal"
  else:  # ADORE's query encoder from the released STAR model, over the index of STAR's document encoder
    c.model.init_from, c.model.description = adore.RELEASED_STAR
    c.model.doc_init_from = adore.RELEASED_STAR[0]
  return c
