"""Multimodal (LLaVA-style) prompts, drafting views and synthetic scene data."""
