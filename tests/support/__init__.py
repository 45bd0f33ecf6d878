"""Shared helpers for tests: locating the model and demo adapters, and the transformers/peft reference."""
