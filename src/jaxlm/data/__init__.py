"""Data: corpora prepared into memory-mapped token files, tokenizers, and checkpointable loaders."""
