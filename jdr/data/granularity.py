"""Document pieces for fine-grained distillation (Zhou et al., FGD): token windows as span masks.

FGD embeds sentences and passages of a long document with the document's own forward pass (Eq. 7:
`jdr.retrieval.span_embeddings.document_and_span_vectors`). Its setting splits the document into consecutive windows of
64 tokens (sentences) and 128 tokens (passages); `windows` builds them as masks over the token axis.
"""

from __future__ import annotations

import math

import numpy as np


def windows(attention_mask: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
  """Consecutive windows of `size` tokens over each row's real tokens after the first ([CLS]).

  attention_mask [B, L] (1 = real token, real tokens first). Returns (span_mask [B, S, L] float32, valid
  [B, S] bool) with S = ceil((L - 1) / size): window s holds positions 1 + s*size ... 1 + (s+1)*size - 1 that
  are real tokens; every real token but [CLS] is in exactly one window, and a window with no real token is
  invalid (short rows have fewer pieces).
  """
  if size < 1:
    raise ValueError(f"window size must be >= 1, got {size}")
  mask = np.asarray(attention_mask).astype(bool)
  _, length = mask.shape
  num = max(1, math.ceil((length - 1) / size))
  position = np.arange(length)
  which = np.where(position >= 1, (position - 1) // size, -1)  # [L]: window of each position, -1 for [CLS]
  span = (which[None, :] == np.arange(num)[:, None])[None, :, :] & mask[:, None, :]
  return span.astype(np.float32), span.any(axis=2)
