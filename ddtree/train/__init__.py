"""Drafter training: prompt collection (``prompts``), data generation and training."""
