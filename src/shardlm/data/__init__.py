"""Training data: ``rows`` (files -> text, prompt/response or chat rows; bad rows counted) and
``dataset`` (tokenized, packed or padded samples, cached; the global batch order and each rank's
micro-batches)."""
