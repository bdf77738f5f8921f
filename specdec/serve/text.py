"""Moved to `specdec.text` (shared by the server, the CLI, the Python API and the benchmark); kept for old imports."""

from specdec.text import PLAIN_CHAT_TEMPLATE, CompletionText, chat_prompt

__all__ = ["PLAIN_CHAT_TEMPLATE", "CompletionText", "chat_prompt"]
