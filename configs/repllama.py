"""RepLLaMA (Ma et al., "Fine-Tuning LLaMA for Multi-Stage Text Retrieval", 2023): Llama-2-7B as a shared
query / passage tower, the EOS token's last-layer state pooled and L2-normalized, LoRA adapters on every
projection of a frozen bfloat16 base, one positive and fifteen hard negatives a query, as the paper and
Tevatron's RepLLaMA example (texttron/tevatron `examples/repllama`: `repllama.py`, `data.py`, `train.py`, its
README's training command) run it.

| setting | full | runlocal | source | where jdr departs, and why |
|---|---|---|---|---|
| starting model | Llama-2-7B, a Hugging Face directory (`model.init_from`, default `models/llama-2-7b`) | a fresh random 2 x 64 Llama (`model.fresh=llama-tiny`) over the MiniLM tokenizer | paper Sec. 2-3; `train.py --model_name_or_path meta-llama/Llama-2-7b-hf` | runlocal: no Llama weights or tokenizer offline; MiniLM's tokenizer ends texts with [SEP] and has no EOS, so nothing is appended there |
| pooling, normalization | the last real token, L2-normalized | the same | `repllama.py` `encode_query` / `encode_passage` (`sequence_lengths - 1`, `normalize`) | |
| EOS | appended to every query and passage after truncation (`model.append_eos`), after Llama's BOS | none (see above) | `data.py` `create_one_example` (`text_encoding + [eos_token_id]`, `prepare_for_model`) | |
| prefixes | "query: " / "passage: " | the same | `data.py` `TrainPreProcessor` | |
| LoRA | r 32, alpha 64, dropout 0.1, on q, k, v, o, gate, up, down | r 8, the same alpha / r, dropout and targets | `repllama.py` `build` (its list omits k_proj; the issue's recipe and the paper's "all linear projections" include it) | k_proj carries adapters; runlocal's rank fits its 64-wide layers |
| base weights | frozen (no gradients, no optimizer state); stored and computed in bfloat16 on accelerators (`model.dtype=auto`, `model.param_dtype=auto`) | float32 on CPU | `train.py --bf16` | |
| negatives | 15 hard negatives a query from Tevatron's MS MARCO training file (a blend of BM25 and CoCondenser results), plus in-batch | 15 BM25 negatives from the top 100 of SciFact's corpus, plus in-batch | paper Sec. 3.1; `train.py --train_n_passages 16`, `--negatives_x_device` | runlocal: no mined file for SciFact |
| loss | softmax cross-entropy over the batch's passages, scores / 0.01 | the same | `repllama.py` `compute_similarity` | |
| optimizer | AdamW 1e-4, 100 warm-up steps then linear decay, no weight decay | AdamW 1e-3, 10 warm-up steps | `train.py` README command; HF Trainer defaults (weight_decay 0, linear schedule) | runlocal: a random base needs larger adapter steps |
| batch | 128 queries (8 a GPU x 4 GPUs x 4 accumulation steps) | 8 | README command | jdr's batch is one softmax over all 128 queries' passages (gradient caching where memory asks), where Tevatron's accumulation makes four softmaxes of 32 |
| lengths | queries 32, passages 196 tokens | the same | README (`--q_max_len 32 --p_max_len 196`) | |
| steps | one epoch of the training file | 120 | README (`--num_train_epochs 1`) | |
| memory | gradient checkpointing (`model.remat`), and gradient caching 512 passages at a time (`grad_cache.chunk_size`) | checkpointing only | README (`--gradient_checkpointing`) | gradient caching is exact and is what fits a 7B step on a v5e chip or in a quarter of an H100 (docs/performance.md, `plan`) |

  python -m jdr.train --config configs/repllama.py:runlocal --workdir runs/repllama-tiny
  python -m jdr.train --config configs/repllama.py --workdir runs/msmarco-repllama   # Llama-2-7B, accelerators
  python -m jdr.train --config configs/repllama.py --compile-only --config.model.init_from= \\
      --config.model.fresh=llama-7b --config.model.append_eos=false --topology h100:8  # sized before it runs
  # on a TPU v5e 4x4 slice the parameters are sharded too: "--config.mesh.shape=(1,16,1)" --config.mesh.rules=fsdp

(Sizing runs with no Llama weights or tokenizer: a fresh 7B shape over the MiniLM tokenizer, which has no EOS.)

Arguments: `runlocal` (above).
"""

import base

ARGS = dict(runlocal=False)
LLAMA_2_7B = ("models/llama-2-7b", "Llama-2-7B, a Hugging Face directory (config.json, safetensors, tokenizer)")
TEVATRON_MSMARCO = ("data/tevatron-msmarco-passage/train.jsonl",
                    "Tevatron's MS MARCO passage training file (JSONL: query, positive_passages, negative_passages)")


def get_config(arg=None):
  a = base.parse_arg(arg, **ARGS)
  c = base.get_config()
  c.model.pooling, c.model.normalize = "last", 1
  c.model.query_prompt, c.model.doc_prompt = "query: ", "passage: "
  c.model.lora_dropout = 0.1
  c.model.lora_targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
  c.model.remat = True
  c.model.dropout = 0.0  # LoRA's dropout is the only one: the base model trains nothing
  c.negatives.per_query = 15
  c.negatives.in_batch = True
  c.loss.name = "softmax_nll"
  c.loss.temperature = 0.01
  c.optimizer.name = "adamw"
  c.optimizer.weight_decay = 0.0
  c.data.query_max_length, c.data.doc_max_length = 32, 196
  if a.runlocal:
    c.data.dataset, c.data.description = base.shared("scifact")
    c.model.init_from, c.model.fresh = "", "llama-tiny"
    c.model.lora_rank, c.model.lora_alpha = 8, 16.0
    c.negatives.source = "bm25"
    c.batch_size = 8
    c.num_train_steps = 120
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_steps = 10
    c.log_every = 20
  else:
    c.data.dataset, c.data.description = base.MSMARCO_PASSAGE
    c.data.eval_split = "dev"
    c.model.init_from, c.model.description = LLAMA_2_7B
    c.model.append_eos = True
    c.model.lora_rank, c.model.lora_alpha = 32, 64.0
    c.negatives.source = "mined"
    c.negatives.mined.file = TEVATRON_MSMARCO[0]
    c.batch_size = 128
    c.num_train_steps = 3_900  # one epoch: about 500k training queries / 128
    c.optimizer.learning_rate = 1e-4
    c.optimizer.warmup_steps = 100
    c.grad_cache.chunk_size = 512
  return c
