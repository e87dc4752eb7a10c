"""Speculative decoding (issue 27): a worker drafts tokens for a decode batch, one target forward
verifies them, and the scheduler commits every accepted token. NGRAM (ngram_worker.py) and
STANDALONE (standalone_worker.py) draft chains and share one verify step (verify_step.py); EAGLE
(eagle_worker.py) drafts token trees with a head on the target's hidden states (tree.py: their
acceptance and KV; layers/attention/spec_tree.py: the tree mask the backends read)."""
