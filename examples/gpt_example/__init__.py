"""Helpers of examples/pretrain_gpt.py: tokenizers and the training data pipeline."""
