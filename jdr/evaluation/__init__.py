"""Evaluation: metrics, the trainer's periodic evaluator and its candidate mode, the evaluation suite, reranking."""
