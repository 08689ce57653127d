"""Encoders (BERT, RoBERTa), towers on top of them, and Hugging Face weight conversion."""
