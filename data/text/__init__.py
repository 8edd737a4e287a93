"""Text pretraining data: WordPiece tokenizer and vocab, demo corpus, NSP pairs, MLM masking, shards, datasets."""
