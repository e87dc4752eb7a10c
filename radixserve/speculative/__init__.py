"""Speculative decoding (issue 27): a worker drafts tokens for a decode batch, one target forward
verifies them, and the scheduler commits every accepted token. NGRAM is built (ngram_worker.py);
STANDALONE and EAGLE are refused at start (server_args.py)."""
