"""Reading, validating and tokenizing retrieval data."""
