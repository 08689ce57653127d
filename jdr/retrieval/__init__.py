"""Retrieval: encoding a corpus, the encoding store, Faiss and exact JAX indexes, the one top-k, BM25 as a first-stage retriever."""
